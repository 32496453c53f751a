package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing"
)

// closingSource is a model source that has something to flush at close (as
// an object store's mirror has its write queue).
type closingSource struct {
	backing.Source
	closed int
}

func (c *closingSource) String() string { return "test source" }
func (c *closingSource) Close() error   { c.closed++; return nil }

// stop releases whatever startDaemon got to build, however little (a
// startup error stops a half-built daemon), and closes the source: before,
// the S3 mirror's queued writes were lost at exit.
func TestStopReleasesAHalfBuiltDaemonAndClosesTheSource(t *testing.T) {
	src := &closingSource{}
	d := &daemon{source: src, log: zap.NewNop()}
	if err := d.stop(true); err != nil {
		t.Fatal(err)
	}
	if src.closed != 1 {
		t.Fatalf("source closed %d times, want once", src.closed)
	}
	if err := (&daemon{log: zap.NewNop()}).stop(true); err != nil {
		t.Fatalf("stop of a daemon with nothing built: %v", err)
	}
}

// A startup error past the source's opening releases it: a bad
// --cache-size is found after the shards are open.
func TestStartupErrorReleasesEverything(t *testing.T) {
	dir := t.TempDir()
	spec := backing.DefaultSynth()
	spec.Rows = 64
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	var mf mountFlags
	fl := newFlagSet("mount", "", "")
	mf.register(fl)
	if err := fl.Parse([]string{"--cache-size", "lots", "--read-engine", "pread"}); err != nil {
		t.Fatal(err)
	}
	mp := t.TempDir()
	if d, err := startDaemon(dir, mp, mf, zap.NewNop()); err == nil {
		_ = d.stop(true)
		t.Fatal("startDaemon with --cache-size lots succeeded")
	}
	if open := openUnder(t, dir); len(open) > 0 {
		t.Fatalf("after the startup error the daemon still holds %v open", open)
	}
}

// openUnder lists the files under dir this process holds open.
func openUnder(t *testing.T, dir string) []string {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	var open []string
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && strings.HasPrefix(target, dir+"/") {
			open = append(open, target)
		}
	}
	return open
}
