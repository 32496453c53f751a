package main

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// checkArgs parses args as engramfs mount's flags and checks them.
func checkArgs(t *testing.T, args ...string) error {
	t.Helper()
	var mf mountFlags
	fl := newFlagSet("mount", "", "")
	mf.register(fl)
	if err := fl.Parse(args); err != nil {
		t.Fatal(err)
	}
	return checkMountFlags(fl, &mf)
}

// Zero and negative counts are refused, not replaced by the default; a
// size without a unit is refused, except 0.
func TestCheckMountFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string // "" for accepted
	}{
		{nil, ""},
		{[]string{"--queue-depth=0"}, "--queue-depth 0: want at least 1"},
		{[]string{"--queue-depth=-3"}, "--queue-depth -3"},
		{[]string{"--queue-depth=8"}, ""},
		{[]string{"--prefetch-queue=0"}, "--prefetch-queue 0"},
		{[]string{"--decode-queue=-1"}, "--decode-queue -1: want at least 256"},
		{[]string{"--decode-queue=255"}, "want at least 256"},
		{[]string{"--decode-queue=256"}, ""},
		{[]string{"--monitor-slack=-1ms"}, "--monitor-slack -1ms: want 0 (off) to 1s"},
		{[]string{"--monitor-slack=2s"}, "want 0 (off) to 1s"},
		{[]string{"--monitor-slack=0"}, ""},
		{[]string{"--cache-size=4"}, `--cache-size "4": a size needs a unit`},
		{[]string{"--cache-size=-1G"}, "cannot be negative"},
		{[]string{"--cache-size=lots"}, "want a size"},
		{[]string{"--cache-size=0"}, ""},
		{[]string{"--cache-size=512MiB"}, ""},
		{[]string{"--cache-size=4g"}, ""},
		{[]string{"--cache-size=4096b"}, ""},
		{[]string{"--s3-mirror-size=100"}, `--s3-mirror-size "100": a size needs a unit`},
		{[]string{"--s3-fill-rate=50"}, `--s3-fill-rate "50": a size needs a unit`},
		{[]string{"--s3-fill-rate=0"}, ""},
		{[]string{"--state-file=" + filepath.Join(t.TempDir(), "missing", "x.state")}, "does not exist"},
		{[]string{"--state-file=" + t.TempDir()}, "is a directory"},
		{[]string{"--state-file=" + filepath.Join(t.TempDir(), "x.state")}, ""},
	} {
		err := checkArgs(t, c.args...)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%q refused: %v", c.args, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%q: %v, want an error saying %q", c.args, err, c.want)
		}
	}
}

// The documented default directory of the state file is made when missing
// (only the systemd unit made it: a mount from fstab could never save).
func TestStateDirDefaultIsMade(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make " + defaultStateDir)
	}
	if _, err := os.Stat(defaultStateDir); err == nil {
		t.Skipf("%s exists already; not removing it", defaultStateDir)
	}
	t.Cleanup(func() { os.RemoveAll(defaultStateDir) })
	if err := checkArgs(t, "--state-file="+defaultStateDir+"/m.state"); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(defaultStateDir); err != nil || !fi.IsDir() {
		t.Fatalf("%s not made: %v", defaultStateDir, err)
	}
}

// A budget above the memory available is warned about; one well below is
// not.
func TestWarnCacheSize(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	warnCacheSize(1<<60, zap.New(core))
	if logs.FilterMessageSnippet("more than the memory available").Len() != 1 {
		t.Errorf("no warning for a 1 EiB tier: %v", logs.All())
	}
	core, logs = observer.New(zap.WarnLevel)
	warnCacheSize(1<<20, zap.New(core))
	if logs.Len() != 0 {
		t.Errorf("a 1 MiB tier warned: %v", logs.All())
	}
}

// A backquoted word in a flag's usage becomes the name of its value in
// --help: "named groups `layer` and `table`" showed as -table-pattern layer.
func TestMountHelpNamesValuesByType(t *testing.T) {
	var mf mountFlags
	fl := newFlagSet("mount", "", "")
	mf.register(fl)
	mf.logFlags.register(fl)
	fl.VisitAll(func(f *flag.Flag) {
		switch name, _ := flag.UnquoteUsage(f); name {
		case "", "string", "int", "value", "duration", "uint", "float":
		default:
			t.Errorf("--help shows -%s %s: a backquoted word in its usage", f.Name, name)
		}
	})
}
