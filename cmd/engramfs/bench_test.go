package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/engramfs/engramfs/internal/testenv"
)

// beside puts a link to (or copy of) the engramfs binary built for the tests
// into a directory of its own, to put a bench next to it or not.
func beside(t *testing.T) (dir, bin string) {
	t.Helper()
	dir = t.TempDir()
	bin = filepath.Join(dir, "engramfs")
	if err := os.Link(testenv.Binary(t), bin); err != nil {
		b, err := os.ReadFile(testenv.Binary(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir, bin
}

// TestBenchHandsOver: engramfs bench and demo exec the engramfs-bench next
// to them with the subcommand, this binary as the daemon, and the
// arguments; its exit status is theirs.
func TestBenchHandsOver(t *testing.T) {
	dir, bin := beside(t)
	fake := "#!/bin/sh\necho \"$@\"\nexit 7\n"
	if err := os.WriteFile(filepath.Join(dir, benchBinary), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{"bench", "demo"} {
		cmd := exec.Command(bin, sub, "--quick", "--json", "x y")
		cmd.Env = append(os.Environ(), "PATH="+t.TempDir())
		out, err := cmd.Output()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Errorf("%s: %v, want the bench's exit status 7", sub, err)
		}
		if want := sub + " --engramfs " + bin + " --quick --json x y\n"; string(out) != want {
			t.Errorf("%s: the bench got %q, want %q", sub, out, want)
		}
	}
}

// TestBenchMissing: without engramfs-bench next to it or on PATH, engramfs
// bench says how to build it.
func TestBenchMissing(t *testing.T) {
	_, bin := beside(t)
	cmd := exec.Command(bin, "bench", "--quick")
	cmd.Env = append(os.Environ(), "PATH="+t.TempDir())
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "go build -o bin/ ./cmd/...") {
		t.Fatalf("%v: %s; want exit 1 naming `go build -o bin/ ./cmd/...`", err, out)
	}
}

// TestBenchReal: with both binaries built side by side, `engramfs bench
// --help` is the bench's help, and a bad flag is the bench's error.
func TestBenchReal(t *testing.T) {
	testenv.Command(t, "engramfs-bench") // next to testenv.Binary
	out, err := exec.Command(testenv.Binary(t), "bench", "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Usage: engramfs bench") || !strings.Contains(string(out), "-engramfs") {
		t.Fatalf("engramfs bench --help: %v\n%s", err, out)
	}
	out, err = exec.Command(testenv.Binary(t), "demo", "--no-such-flag").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "engramfs demo: flag provided but not defined: -no-such-flag") {
		t.Fatalf("engramfs demo --no-such-flag: %v, want the bench's error\n%s", err, out)
	}
}

// TestDaemonDoesNotLinkTheBench: the daemon binary stays free of the
// bench's charting and statistics (gonum/plot and what it pulls in).
func TestDaemonDoesNotLinkTheBench(t *testing.T) {
	out, err := exec.Command(testenv.GoTool(), "list", "-deps", "github.com/engramfs/engramfs/cmd/engramfs").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		if strings.Contains(p, "gonum.org/") || p == "github.com/engramfs/engramfs/bench" {
			t.Errorf("cmd/engramfs links %s", p)
		}
	}
}
