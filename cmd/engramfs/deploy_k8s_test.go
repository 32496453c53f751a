package main

import (
	"encoding/json"
	"flag"
	"io"
	"os"
	"strings"
	"testing"
)

// deploy/kubernetes.yaml's daemon command parses as engramfs mount, and the
// manifest keeps what the mount needs in a container.
func TestKubernetesExampleParses(t *testing.T) {
	b, err := os.ReadFile("../../deploy/kubernetes.yaml")
	if err != nil {
		t.Fatal(err)
	}
	manifest := string(b)
	var command []string
	for _, l := range strings.Split(manifest, "\n") {
		if c, ok := strings.CutPrefix(strings.TrimSpace(l), "command: "); ok {
			if err := json.Unmarshal([]byte(c), &command); err != nil {
				t.Fatalf("command %s: %v", c, err)
			}
		}
	}
	if len(command) < 4 || command[1] != "mount" {
		t.Fatalf("command %q is not engramfs mount", command)
	}
	fl := flag.NewFlagSet("mount", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	var mf mountFlags
	mf.register(fl)
	mf.logFlags.register(fl)
	if err := fl.Parse(command[2:]); err != nil || fl.NArg() != 2 {
		t.Fatalf("command flags %q: %v, args %q", command[2:], err, fl.Args())
	}
	for _, want := range []string{"privileged: true", "mountPropagation: Bidirectional", "mountPropagation: HostToContainer",
		"path: /dev/fuse", "DSV41_ENGRAM_PREFETCH_MODE, value: engramfs", "DSV41_ENGRAMFS_MOUNT, value: " + fl.Arg(1)} {
		if !strings.Contains(manifest, want) {
			t.Errorf("the manifest lacks %q", want)
		}
	}
}
