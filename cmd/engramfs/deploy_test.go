package main

import (
	"bufio"
	"flag"
	"io"
	"os"
	"strings"
	"testing"
)

// The files in deploy/ name flags and options of this binary: they must
// keep parsing as the binary changes.

func TestSystemdUnitFlagsParse(t *testing.T) {
	unit, err := os.ReadFile("../../deploy/engramfs@.service")
	if err != nil {
		t.Fatal(err)
	}
	conf, err := os.ReadFile("../../deploy/engramfs.conf.example")
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"STATE_DIRECTORY": "/var/lib/engramfs"}
	sc := bufio.NewScanner(strings.NewReader(string(conf)))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			env[k] = v
		}
	}
	var exec string
	for _, l := range strings.Split(string(unit), "\n") {
		if strings.HasPrefix(l, "ExecStart=") {
			exec = strings.TrimPrefix(l, "ExecStart=")
		}
	}
	if !strings.Contains(string(unit), "Type=notify") || !strings.Contains(string(unit), "LimitMEMLOCK=infinity") {
		t.Fatal("the unit is not Type=notify with LimitMEMLOCK=infinity")
	}
	words := strings.Fields(os.Expand(strings.ReplaceAll(exec, "%i", "dsv41"), func(k string) string { return env[k] }))
	if len(words) < 4 || words[1] != "mount" {
		t.Fatalf("ExecStart %q is not engramfs mount", exec)
	}
	fl := flag.NewFlagSet("mount", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	var mf mountFlags
	mf.register(fl)
	mf.logFlags.register(fl)
	if err := fl.Parse(words[2:]); err != nil {
		t.Fatalf("ExecStart flags %q: %v", words[2:], err)
	}
	if fl.NArg() != 2 || fl.Arg(0) != env["MODEL_DIR"] || mf.stateFile != "/var/lib/engramfs/dsv41.state" || mf.cacheSize != "4G" {
		t.Fatalf("ExecStart parsed to %+v, args %q", mf, fl.Args())
	}
}

func TestFstabExampleParses(t *testing.T) {
	b, err := os.ReadFile("../../deploy/fstab.example")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) != 6 || f[2] != "fuse.engramfs" {
			t.Fatalf("fstab line %q: want 6 fields of type fuse.engramfs", l)
		}
		h, err := parseHelperArgs([]string{f[0], f[1], "-o", f[3]})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := mountArgs(h, io.Discard); err != nil {
			t.Fatalf("fstab line %q: %v", l, err)
		}
		n++
	}
	if n == 0 {
		t.Fatal("no fstab line in the example")
	}
}
