package daemonproc_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/testenv"
)

// TestStartReadStop mounts a small model with the real binary, reads its
// stats, CPU and memory, and stops it: the mount and the mountpoint Start
// made are gone, and the log is still there to read.
func TestStartReadStop(t *testing.T) {
	testenv.RequireFUSE(t)
	model := filepath.Join(t.TempDir(), "model")
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	if err := backing.Synthesize(model, spec); err != nil {
		t.Fatal(err)
	}
	dir := testenv.PrivateTempDir(t)
	d, err := daemonproc.Start(context.Background(), daemonproc.Options{
		Binary: testenv.Binary(t), ModelDir: model, MountDir: dir, LogDir: t.TempDir(),
		Flags: []string{"--log-format", "json"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	if !procfs.Mounted(d.Mountpoint) || filepath.Dir(d.Mountpoint) != dir {
		t.Fatalf("%s: not mounted, or not under %s", d.Mountpoint, dir)
	}
	if _, err := os.ReadFile(filepath.Join(d.Mountpoint, "manifest.json")); err != nil {
		t.Fatal(err)
	}
	st, err := d.Stats()
	if err != nil || st.Pid != d.Pid() {
		t.Fatalf("stats pid %d, %v; daemon pid %d", st.Pid, err, d.Pid())
	}
	if _, err := d.CPU(); err != nil {
		t.Error(err)
	}
	if m, err := d.Mem(); err != nil || m.RSS <= 0 || m.HWM < m.RSS {
		t.Errorf("mem %+v, %v", m, err)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if procfs.Mounted(d.Mountpoint) {
		t.Error("still mounted after Stop")
	}
	if _, err := os.Stat(d.Mountpoint); !os.IsNotExist(err) {
		t.Errorf("mountpoint left: %v", err)
	}
	if _, err := os.Stat(d.LogPath); !os.IsNotExist(err) {
		t.Errorf("log file of a clean stop left: %v", err)
	}
	if !strings.Contains(d.Log(), `"mounted"`) {
		t.Errorf("log after Stop lacks the mount:\n%s", d.Log())
	}
	if err := d.Stop(); err != nil {
		t.Errorf("a second Stop: %v", err)
	}
}

// fake writes a shell script that stands in for engramfs: it says it
// mounted (console log format) and then runs body.
func fake(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "engramfs")
	script := "#!/bin/sh\nprintf '2026-12-01T00:00:00Z\\tINFO\\tmounted\\t{}\\n'\n" + body + "\n"
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestStopReportsABadExit: a daemon that ignores SIGTERM is killed, one that
// exits non-zero is reported, each with its log, which is kept.
func TestStopReportsABadExit(t *testing.T) {
	for _, c := range []struct{ name, body, want string }{
		{"ignores SIGTERM", "trap '' TERM\necho 'still here' >&2\nwhile :; do sleep 0.1; done", "killed it"},
		{"exits 3", "trap 'echo dying >&2; exit 3' TERM\nwhile :; do sleep 0.1; done", "exit status 3"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			d, err := daemonproc.Start(context.Background(), daemonproc.Options{
				Binary: fake(t, c.body), ModelDir: "model", MountDir: dir, LogDir: t.TempDir(), StopTimeout: time.Second,
			})
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond) // the trap is set
			err = d.Stop()
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), d.LogPath) {
				t.Fatalf("Stop: %v; want %q and the log's path", err, c.want)
			}
			if _, serr := os.Stat(d.LogPath); serr != nil {
				t.Errorf("log of a failed stop not kept: %v", serr)
			}
			if d.Stop() != err {
				t.Error("a second Stop does not repeat the first's result")
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 0 {
				t.Errorf("mountpoint left: %v", ents)
			}
		})
	}
}

// TestStartFails: a daemon that exits before mounting, or never mounts in
// time, is an error with its output, and nothing is left behind.
func TestStartFails(t *testing.T) {
	for _, c := range []struct {
		name, script, want string
	}{
		{"exits", "#!/bin/sh\necho 'fatal: no such model' >&2\nexit 1\n", "exited before mounting"},
		{"hangs", "#!/bin/sh\necho 'thinking' >&2\nexec sleep 100\n", "did not mount within"},
	} {
		t.Run(c.name, func(t *testing.T) {
			bin := filepath.Join(t.TempDir(), "engramfs")
			if err := os.WriteFile(bin, []byte(c.script), 0o755); err != nil {
				t.Fatal(err)
			}
			dir, logs := t.TempDir(), t.TempDir()
			_, err := daemonproc.Start(context.Background(), daemonproc.Options{
				Binary: bin, ModelDir: "model", MountDir: dir, LogDir: logs, MountTimeout: 500 * time.Millisecond, StopTimeout: 5 * time.Second,
			})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Start: %v; want %q", err, c.want)
			}
			if !strings.Contains(err.Error(), "no such model") && !strings.Contains(err.Error(), "thinking") {
				t.Errorf("the error lacks the daemon's output: %v", err)
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 0 {
				t.Errorf("mountpoint left: %v", ents)
			}
		})
	}
}

func TestSummary(t *testing.T) {
	// All of it before "mounted", so that it is there when Start returns.
	bin := filepath.Join(t.TempDir(), "engramfs")
	script := `#!/bin/sh
echo '{"level":"info","msg":"noise"}'
echo '{"level":"warn","msg":"slow backing"}'
echo '{"level":"warn","msg":"slow backing"}'
echo 'panic: out of luck'
echo '	goroutine 1 [running]:'
echo '{"level":"info","msg":"mounted"}'
exec sleep 100
`
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	d, err := daemonproc.Start(context.Background(), daemonproc.Options{Binary: bin, ModelDir: "m", MountDir: t.TempDir(), LogDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop() // a killed sleep: an error, of no interest here
	s := d.Summary()
	if strings.Count(s, "slow backing") != 3 || strings.Count(s, "noise") != 1 || strings.Contains(s[:strings.Index(s, "... and its last lines")], "noise") ||
		!strings.Contains(s, "panic: out of luck") {
		t.Errorf("summary: want the warning once (and twice in the tail), the panic, no info lines above the tail:\n%s", s)
	}
}
