// Package tests holds the end-to-end tests of engramfs: real FUSE mounts
// served by the engramfs binary in its own process, read by the test process
// (and by Python) through read(2) and mmap, checked against the shard bytes.
//
// This file is the harness the tests share, on internal/daemonproc (the
// daemon) and internal/testenv (FUSE, the binary). Mount tests need root and
// /dev/fuse; where FUSE is unavailable they skip, unless
// ENGRAMFS_REQUIRE_FUSE=1 (as in CI), which turns the skip into a failure.
package tests

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/procfs"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/testenv"
)

// The harness's names for testenv's helpers, as the tests have always
// called them.
var (
	RequireFUSE = testenv.RequireFUSE
	Binary      = testenv.Binary
	Mounted     = procfs.Mounted
)

// Synth writes a synthetic model into a temporary directory.
func Synth(t testing.TB, spec backing.SynthSpec) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	if err := backing.Synthesize(dir, spec); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Daemon is an `engramfs mount` process, stopped (and its mount checked
// gone) when the test ends.
type Daemon struct{ *daemonproc.Daemon }

// Mount starts `engramfs mount [args] modelDir MOUNTPOINT` on a fresh
// mountpoint and waits for it to mount.
func Mount(t testing.TB, modelDir string, args ...string) *Daemon {
	t.Helper()
	return start(t, daemonproc.Options{ModelDir: modelDir, Flags: args})
}

// MountAt is Mount on a given mountpoint.
func MountAt(t testing.TB, modelDir, mp string, args ...string) *Daemon {
	t.Helper()
	return start(t, daemonproc.Options{ModelDir: modelDir, Flags: args, Mountpoint: mp})
}

// MountWrapped is Mount with the daemon started through wrapper, a command
// that ends by exec'ing the daemon's command line, which is appended to it
// (so the daemon keeps the wrapper's pid): e.g. capsh dropping a
// capability, or a shell setting a ulimit.
func MountWrapped(t testing.TB, wrapper []string, modelDir string, args ...string) *Daemon {
	t.Helper()
	return start(t, daemonproc.Options{ModelDir: modelDir, Flags: args, Wrapper: wrapper})
}

// fuseTransport, when set, is the --fuse-transport of every daemon the
// harness starts without one of its own: ENGRAMFS_FUSE_TRANSPORT, or the
// transport TestMountSuiteOnBothTransports runs the core tests on.
var fuseTransport = os.Getenv("ENGRAMFS_FUSE_TRANSPORT")

func start(t testing.TB, o daemonproc.Options) *Daemon {
	t.Helper()
	RequireFUSE(t)
	if fuseTransport != "" && !slices.ContainsFunc(o.Flags, func(f string) bool { return strings.HasPrefix(f, "--fuse-transport") }) {
		o.Flags = append([]string{"--fuse-transport", fuseTransport}, o.Flags...)
	}
	o.Binary = Binary(t)
	if o.Mountpoint == "" {
		o.MountDir = testenv.PrivateTempDir(t)
	}
	// o.LogDir stays the system's temporary directory: the log of a daemon
	// that did not stop cleanly is kept there, past the test's own files.
	dd, err := daemonproc.Start(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{dd}
	t.Cleanup(func() { d.Stop(t) })
	return d
}

// mountAt is a handle on the mount at mp that another process (a mount
// helper) started: its Mountpoint and Stats work, nothing that needs the
// process.
func mountAt(mp string) *Daemon { return &Daemon{&daemonproc.Daemon{Mountpoint: mp}} }

// Stop stops the daemon (daemonproc.Daemon.Stop) and fails t if that went
// wrong: no clean exit on SIGTERM, or the mount left behind.
func (d *Daemon) Stop(t testing.TB) {
	t.Helper()
	if err := d.Daemon.Stop(); err != nil {
		t.Error(err)
	}
}

// Stats reads .engramfs/stats.
func (d *Daemon) Stats(t testing.TB) stats.Snapshot {
	t.Helper()
	s, err := d.Daemon.Stats()
	if err != nil {
		t.Fatalf("read stats: %v", err)
	}
	return s
}

// syncBuffer is a bytes.Buffer that a command's output goroutine and the
// test can share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ShardTable returns the bytes of a table tensor read straight from its
// shard: what every byte of the mount must equal.
func ShardTable(t testing.TB, modelDir, name string) []byte {
	t.Helper()
	for _, tb := range Model(t, modelDir).Tables {
		if tb.Name != name {
			continue
		}
		f, err := os.Open(tb.Shard.Path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b := make([]byte, tb.DataLen)
		if _, err := io.ReadFull(io.NewSectionReader(f, tb.DataStart, tb.DataLen), b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	t.Fatalf("no table %q in %s", name, modelDir)
	return nil
}

// Model loads modelDir with the default pattern.
func Model(t testing.TB, modelDir string) *backing.Model {
	t.Helper()
	m, err := backing.Load(modelDir, backing.DefaultTablePattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// sink keeps Touch's loads from being optimised away.
var sink byte

// Touch reads one byte of a mapping: a page fault when the page is cold.
//
//go:noinline
func Touch(m []byte, off int) byte {
	sink += m[off]
	return m[off]
}

// CPU is the CPU time a process's live threads have used, in nanoseconds
// (procfs.SchedCPU).
func CPU(t testing.TB, pid int) time.Duration {
	t.Helper()
	d, err := procfs.SchedCPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	return d
}
