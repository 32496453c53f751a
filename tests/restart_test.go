package tests

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/hints/client"
	"github.com/engramfs/engramfs/internal/daemonproc"
	"github.com/engramfs/engramfs/internal/procfs"
)

// restartReaderEnv runs the test binary as TestRestartUnderReaders's
// reader (TestMain): a process of its own, as an engine's rank is.
const restartReaderEnv = "ENGRAMFS_RESTART_READER"

// restartReaderWork is what the reader is told.
type restartReaderWork struct {
	Mount, ModelDir, StopFile, Out string
	Rows                           int // rows gathered per layer per step
}

// restartReaderResult is what the reader reports.
type restartReaderResult struct {
	Steps  int
	Errors []string
	// Each step's start (ns since the epoch) and duration (ns): the hint,
	// its barrier, and the gather of every row of every table.
	Start, Took []int64
}

// TestRestartUnderReaders restarts the daemon 10 times (engramfs restart)
// under a reader process that, every step, hints rows through the Go client
// (decode, then the barrier) and gathers them from its mappings of every
// table, checking each row against the shard: no error, no SIGBUS, every
// row right; each successor pins the hot set it was handed again (at least
// 99% of it). The gap a reader sees during a restart (the longest step
// overlapping each restart, p99 across restarts) and the time to pin are
// logged, not asserted (a shared machine).
func TestRestartUnderReaders(t *testing.T) {
	d, dir, env, latest := startRestartable(t, "--cache-size=32MiB")
	mp := d.Mountpoint
	handedTo := regexp.MustCompile(`handed the mount to pid (\d+)`)

	stopFile := filepath.Join(t.TempDir(), "stop")
	out := filepath.Join(t.TempDir(), "result.json")
	work, _ := json.Marshal(restartReaderWork{Mount: mp, ModelDir: dir, StopFile: stopFile, Out: out, Rows: 16})
	reader := exec.Command(os.Args[0], "-test.run=^$")
	reader.Env = append(os.Environ(), restartReaderEnv+"="+string(work))
	var readerLog syncBuffer
	reader.Stdout, reader.Stderr = &readerLog, &readerLog
	if err := reader.Start(); err != nil {
		t.Fatal(err)
	}
	readerDone := make(chan error, 1)
	go func() { readerDone <- reader.Wait() }()
	readerExited := false
	defer func() {
		if !readerExited {
			_ = reader.Process.Kill()
			<-readerDone
		}
	}()
	steps := func() int {
		st := d.Stats(t)
		return int(st.HintFrames)
	}
	waitFor(t, "the reader's first steps", func() bool { return steps() > 20 })

	const restarts = 10
	type window struct{ from, to time.Time }
	var windows []window
	warmLine := regexp.MustCompile(`warm restart finished.*"pages": (\d+), "pinned": (\d+), "took": "([^"]+)"`)
	for i := range restarts {
		before := steps()
		from := time.Now()
		cmd := exec.Command(Binary(t), "restart", mp)
		cmd.Env = append(os.Environ(), env...)
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("restart %d: %v\n%s\ndaemon log:\n%s", i+1, err, b, d.Log())
		}
		windows = append(windows, window{from, time.Now()})
		if m := handedTo.FindSubmatch(b); m != nil {
			*latest, _ = strconv.Atoi(string(m[1]))
		}
		t.Logf("restart %d: %s", i+1, strings.TrimSpace(string(b)))
		// The successor logs where the first daemon did; it pins the hot
		// set it was handed before it says the warm restart finished.
		waitFor(t, fmt.Sprintf("restart %d's warm restart", i+1), func() bool {
			return len(warmLine.FindAllStringSubmatch(d.Log(), -1)) >= i+1
		})
		m := warmLine.FindAllStringSubmatch(d.Log(), -1)[i]
		pages, _ := strconv.Atoi(m[1])
		pinned, _ := strconv.Atoi(m[2])
		if pages == 0 {
			t.Fatalf("restart %d: the successor was handed no hot set", i+1)
		}
		if pinned*100 < pages*99 {
			t.Errorf("restart %d: %d of %d hot pages pinned again, want at least 99%%", i+1, pinned, pages)
		}
		t.Logf("restart %d: %d of %d hot pages pinned again in %s", i+1, pinned, pages, m[3])
		waitFor(t, fmt.Sprintf("steps after restart %d", i+1), func() bool { return steps() > before+20 })
	}

	if err := os.WriteFile(stopFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-readerDone:
		readerExited = true
		if err != nil {
			// A SIGBUS kills it: "signal: bus error".
			t.Fatalf("reader: %v\n%s", err, readerLog.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("the reader did not stop within 60 s\n%s", readerLog.String())
	}
	var res restartReaderResult
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) > 0 {
		t.Fatalf("the reader saw %d errors across %d restarts: %q\nthe daemons' warnings:\n%s",
			len(res.Errors), restarts, res.Errors, warnings(d.Log()))
	}
	var gaps []time.Duration
	for _, w := range windows {
		worst := time.Duration(0)
		for i := range res.Start {
			s, e := time.Unix(0, res.Start[i]), time.Unix(0, res.Start[i]+res.Took[i])
			if e.After(w.from) && s.Before(w.to) {
				worst = max(worst, time.Duration(res.Took[i]))
			}
		}
		gaps = append(gaps, worst)
	}
	all := make([]time.Duration, len(res.Took))
	for i, d := range res.Took {
		all[i] = time.Duration(d)
	}
	t.Logf("reader: %d steps, 0 errors across %d restarts; step time p50 %v, p99 %v; "+
		"the gap a reader sees during a restart (its longest step overlapping one) p99 %v, max %v",
		res.Steps, restarts, quantile(all, 0.5), quantile(all, 0.99), quantile(gaps, 0.99), slices.Max(gaps))
}

// restartRows is the rows a table of startRestartable's model has.
const restartRows = 4096

// startRestartable mounts a synthetic model of restartRows rows with flags,
// its handover socket in a directory of its own. The caller sets *latest
// to the pid of the daemon it hands the mount to last: that one is
// stopped at the end, before the harness stops the first one (long gone:
// it handed over).
func startRestartable(t *testing.T, flags ...string) (d *Daemon, modelDir string, env []string, latest *int) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = restartRows
	modelDir = Synth(t, spec)
	env = []string{"ENGRAMFS_RUN_DIR=" + t.TempDir()}
	d = start(t, daemonproc.Options{ModelDir: modelDir, Flags: flags, Env: env})
	latest = new(int)
	t.Cleanup(func() { stopLatest(t, d.Mountpoint, *latest) })
	return d, modelDir, env, latest
}

// warnings are the lines of a daemon log above INFO.
func warnings(log string) string {
	var b strings.Builder
	for _, l := range strings.Split(log, "\n") {
		if l != "" && !strings.Contains(l, "\tINFO\t") && !strings.Contains(l, "\tDEBUG\t") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// stopLatest stops the daemon pid serving mp (a successor the test did
// not start) and waits for it to exit and the mount to go.
func stopLatest(t *testing.T, mp string, pid int) {
	if pid == 0 {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(30 * time.Second)
	for procfs.Alive(pid) || procfs.Mounted(mp) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			_ = unix.Unmount(mp, unix.MNT_DETACH)
			t.Errorf("the last daemon (pid %d) did not stop within 30 s of SIGTERM", pid)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// runRestartReader is the reader of TestRestartUnderReaders: it steps until
// the stop file appears, then writes its result.
func runRestartReader(arg string) error {
	var w restartReaderWork
	if err := json.Unmarshal([]byte(arg), &w); err != nil {
		return err
	}
	m, err := backing.Load(w.ModelDir, backing.DefaultTablePattern)
	if err != nil {
		return err
	}
	h, err := client.Open(w.Mount)
	if err != nil {
		return err
	}
	defer h.Close()
	maps := make([][]byte, len(m.Tables))
	shards := map[string]*os.File{}
	for _, tb := range m.Tables {
		f, err := os.Open(filepath.Join(w.Mount, tb.Path()))
		if err != nil {
			return err
		}
		b, err := unix.Mmap(int(f.Fd()), 0, int(tb.FileSize), unix.PROT_READ, unix.MAP_SHARED)
		f.Close()
		if err != nil {
			return err
		}
		defer unix.Munmap(b)
		maps[tb.ID] = b
		if shards[tb.Shard.Path] == nil {
			if shards[tb.Shard.Path], err = os.Open(tb.Shard.Path); err != nil {
				return err
			}
		}
	}
	var res restartReaderResult
	fail := func(format string, a ...any) {
		if len(res.Errors) < 100 {
			res.Errors = append(res.Errors, fmt.Sprintf(format, a...))
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	want := make([]byte, 64<<10)
	got := make([]byte, 64<<10)
	for step := 0; ; step++ {
		if _, err := os.Stat(w.StopFile); err == nil {
			break
		}
		t0 := time.Now()
		for _, layer := range m.Layers {
			rows, _ := m.LayerRows(layer)
			pick := make([]uint64, w.Rows)
			for i := range pick {
				// A few hundred popular rows: the hot set the tier keeps.
				pick[i] = uint64(rng.IntN(512)) * 7 % rows
			}
			if err := h.Decode(layer, pick); err != nil {
				fail("step %d layer %d: hint: %v", step, layer, err)
			}
			if err := h.Wait(); err != nil {
				fail("step %d layer %d: barrier: %v", step, layer, err)
			}
			for _, tb := range m.LayerTables(layer) {
				for _, r := range pick {
					off := int64(len(tb.FileHeader)) + int64(r)*tb.RowBytes
					n := copy(got, maps[tb.ID][off:off+tb.RowBytes])
					if _, err := shards[tb.Shard.Path].ReadAt(want[:n], tb.DataStart+int64(r)*tb.RowBytes); err != nil {
						return err
					}
					if !bytes.Equal(got[:n], want[:n]) {
						fail("step %d: %s row %d: wrong bytes through the mapping", step, tb.Name, r)
					}
				}
			}
		}
		res.Start = append(res.Start, t0.UnixNano())
		res.Took = append(res.Took, int64(time.Since(t0)))
		res.Steps++
	}
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	return os.WriteFile(w.Out, b, 0o644)
}

// TestCrashTakeoverFromFdStore: a daemon that dies (SIGKILL) leaves the
// mount alive when the service manager keeps its FUSE connection
// (FDSTORE=1 over $NOTIFY_SOCKET; played here by the test): the next start,
// handed the connection in $LISTEN_FDS, takes the mount over, and a table
// opened and mapped before the crash (a reader's handle, which the dead
// daemon alone knew) reads the right bytes, cold pages included, with no
// error.
func TestCrashTakeoverFromFdStore(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	dir := Synth(t, spec)
	m := Model(t, dir)
	tb := m.Tables[len(m.Tables)-1]
	want := ShardTable(t, dir, tb.Name)
	hdr := len(tb.FileHeader)
	var (
		f      *os.File
		mapped []byte
	)
	crashTakeover(t, dir, []string{"--cache-size=8MiB"}, func(mp string) {
		var err error
		if f, err = os.Open(filepath.Join(mp, tb.Path())); err != nil {
			t.Fatal(err)
		}
		if mapped, err = unix.Mmap(int(f.Fd()), 0, int(tb.FileSize), unix.PROT_READ, unix.MAP_SHARED); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(mapped[hdr:hdr+100], want[:100]) {
			t.Fatal("wrong bytes before the crash")
		}
	})
	// Before the successor stops (crashTakeover's cleanup).
	defer f.Close()
	defer unix.Munmap(mapped)
	// Every page of the mapping made before the crash, through a system
	// call (see fs's handover test: no Go fault on a FUSE page in a test).
	got := make([]byte, len(want))
	scratch, err := os.CreateTemp(t.TempDir(), "table")
	if err != nil {
		t.Fatal(err)
	}
	defer scratch.Close()
	if _, err := scratch.WriteAt(mapped[hdr:hdr+len(want)], 0); err != nil {
		t.Fatalf("reading the mapping after the crash: %v", err)
	}
	if _, err := scratch.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the mapping made before the crash reads wrong bytes after the takeover")
	}
}

// TestCrashTakeoverKeepsModelFileHandles: model files the daemon reads
// itself (--passthrough=false: every read goes through the handle's backing
// file), open across a crash, read their own bytes after the fd-store
// takeover, although the successor numbers its handles from 1 again as the
// dead daemon did, and files opened after the takeover (before the old
// handles are used again) read theirs; closing the old handles leaves the
// new ones working.
func TestCrashTakeoverKeepsModelFileHandles(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	dir := Synth(t, spec)
	names := append([]string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}, backing.SynthConfigFiles...)
	want := map[string][]byte{}
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		want[n] = b
	}
	// check reads all of f from the daemon (its page cache dropped first:
	// KEEP_CACHE would answer from pages read before) and compares.
	check := func(what, name string, f *os.File) {
		t.Helper()
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(want[name])+1)
		n, err := f.ReadAt(got, 0)
		if err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("%s %s: %v", what, name, err)
		}
		if !bytes.Equal(got[:n], want[name]) {
			t.Fatalf("%s %s: %d bytes, not the file's %d", what, name, n, len(want[name]))
		}
	}
	var old []*os.File
	mp, log := crashTakeover(t, dir, []string{"--cache-size=8MiB", "--passthrough=false"}, func(mp string) {
		for _, n := range names {
			f, err := os.Open(filepath.Join(mp, n))
			if err != nil {
				t.Fatal(err)
			}
			// One page: no readahead starts.
			if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil && !errors.Is(err, io.EOF) {
				t.Fatalf("read before the crash: %s: %v", n, err)
			}
			old = append(old, f)
		}
	})
	defer func() {
		for _, f := range old {
			f.Close()
		}
	}()
	// New opens first, in another order: the successor's go-fuse gives
	// them the numbers the dead daemon's gave the old ones.
	var fresh []*os.File
	for i := range names {
		n := names[len(names)-1-i]
		f, err := os.Open(filepath.Join(mp, n))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		fresh = append(fresh, f)
	}
	for i, f := range fresh {
		check("opened after the takeover", names[len(names)-1-i], f)
	}
	for i, f := range old {
		check("open across the crash", names[i], f)
	}
	if !strings.Contains(log.String(), "model files are read by the daemon") {
		t.Fatalf("the successor read no model file itself (passthrough?); its log:\n%s", log.String())
	}
	for _, f := range old {
		if err := f.Close(); err != nil {
			t.Fatalf("closing a handle open across the crash: %v", err)
		}
	}
	for i, f := range fresh {
		check("opened after the takeover, the old handles closed", names[len(names)-1-i], f)
	}
}

// crashTakeover mounts dir (with flags) under a daemon that keeps its FUSE
// connection in a file descriptor store (FDSTORE=1 over $NOTIFY_SOCKET;
// the test plays the service manager), runs before on the mountpoint,
// kills the daemon (SIGKILL) and starts the next one as systemd does,
// handed the kept connection in $LISTEN_FDS. It returns once that one
// took the mount over, with its log; it is stopped at cleanup.
func crashTakeover(t *testing.T, dir string, flags []string, before func(mp string)) (string, *syncBuffer) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "notify")
	ln, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	env := []string{"NOTIFY_SOCKET=" + sock, "ENGRAMFS_RUN_DIR=" + t.TempDir()}
	a := start(t, daemonproc.Options{ModelDir: dir, Flags: flags, Env: env})
	mp := a.Mountpoint
	var stored *os.File
	deadline := time.Now().Add(30 * time.Second)
	for stored == nil {
		_ = ln.SetReadDeadline(deadline)
		buf, oob := make([]byte, 4096), make([]byte, 64)
		n, oobn, _, _, err := ln.ReadMsgUnix(buf, oob)
		if err != nil {
			t.Fatalf("no FDSTORE=1 from the daemon: %v", err)
		}
		if !strings.Contains(string(buf[:n]), "FDSTORE=1") {
			continue
		}
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		if len(msgs) != 1 {
			t.Fatalf("FDSTORE=1 came with %d control messages", len(msgs))
		}
		fds, err := unix.ParseUnixRights(&msgs[0])
		if err != nil || len(fds) != 1 {
			t.Fatalf("FDSTORE=1 rights: %v, %v", fds, err)
		}
		stored = os.NewFile(uintptr(fds[0]), "fdstore")
	}
	defer stored.Close()

	before(mp)
	if err := a.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// A killed daemon whose own thread waits on a request it had read from
	// its own mount (the pinner opening or faulting a table) cannot finish
	// exiting: the kernel waits for that request's answer, uninterruptibly,
	// and the kept descriptor keeps the connection alive. The successor's
	// resend answers it; so the successor starts once the process is dead
	// or stuck so, and the predecessor must be gone after the takeover.
	select {
	case <-a.Exited():
	case <-time.After(5 * time.Second):
		t.Logf("the killed daemon has not exited after 5 s (threads: %s): starting its successor, whose resend must release it", threadStates(a.Pid()))
	}

	// The next start, as systemd makes it: the kept descriptor as fd 3.
	log := &syncBuffer{}
	args := append(append([]string{"-c", `LISTEN_PID=$$ exec "$0" "$@"`, Binary(t), "mount"}, flags...), dir, mp)
	b := exec.Command("sh", args...)
	b.Env = append(os.Environ(), append(env, "LISTEN_FDS=1", "LISTEN_FDNAMES=engramfs-fuse")...)
	b.ExtraFiles = []*os.File{stored}
	b.Stdout, b.Stderr = log, log
	if err := b.Start(); err != nil {
		t.Fatal(err)
	}
	bDone := make(chan error, 1)
	go func() { bDone <- b.Wait() }()
	t.Cleanup(func() { stopLatest(t, mp, b.Process.Pid) })
	waitFor(t, "the next start to take the mount over", func() bool {
		select {
		case err := <-bDone:
			t.Fatalf("the next start exited: %v\n%s", err, log.String())
		default:
		}
		return strings.Contains(log.String(), "took the mount over from the service manager")
	})
	select {
	case <-a.Exited():
	case <-time.After(30 * time.Second):
		t.Fatalf("the killed daemon (pid %d) did not exit within 30 s of its successor's takeover (threads: %s)\n%s", a.Pid(), threadStates(a.Pid()), log.String())
	}
	return mp, log
}

// threadStates is procfs.ThreadStates, or why it failed.
func threadStates(pid int) string {
	s, err := procfs.ThreadStates(pid)
	if err != nil {
		return err.Error()
	}
	return s
}

// A successor is handed the pages its predecessor put in the page cache
// (cache.Seen): a hint of rows nobody ever read is known uncached without
// asking the kernel, as before the restart; rows another process faulted
// in before the restart are looked up and found, not read again. Before,
// a successor knew nothing and asked mincore of every page.
//
// The rows faulted in must stay cached from before the restart to the
// hint after it: where the page cache was dropped from outside meanwhile
// (a benchmark beside the suite drops it before each of its phases), the
// check cannot be judged, and the whole attempt (a new mount, fault-in,
// restart) runs again.
func TestRestartCarriesServedPages(t *testing.T) {
	untilNoOutsideDrop(t, "a restart's carried pages", func() error { return restartCarriesServedPages(t) })
}

// restartCarriesServedPages is one attempt of TestRestartCarriesServedPages,
// on a mount of its own: the error of its check of the rows faulted in
// before the restart.
func restartCarriesServedPages(t *testing.T) error {
	d, _, env, latest := startRestartable(t, "--cache-size=0")
	mp := d.Mountpoint
	spec := backing.DefaultSynth()
	spec.Rows = restartRows
	m := Model(t, d.ModelDir)
	rng := rand.New(rand.NewPCG(61, 62))
	// Far apart, so no page and no lookup window (runs < 32 pages apart)
	// holds rows of both: the first quarter of the rows, the last.
	faulted := randomRows(rng, 30, uint64(spec.Rows)/4)
	never := randomRows(rng, 30, uint64(spec.Rows)/4)
	for i := range never {
		never[i] += 3 * uint64(spec.Rows) / 4
	}
	// --cache-size=0: nothing is pinned, so a hint looks every page up.
	// The mappings keep the table inodes known across the restart.
	maps := layerMaps(t, d, m, 0)
	faultInFromAnotherProcess(t, d, m, 0, faulted)

	cmd := exec.Command(Binary(t), "restart", mp)
	cmd.Env = append(os.Environ(), env...)
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("restart: %v\n%s\ndaemon log:\n%s", err, b, d.Log())
	}
	if m := regexp.MustCompile(`handed the mount to pid (\d+)`).FindSubmatch(b); m != nil {
		*latest, _ = strconv.Atoi(string(m[1]))
	}
	h, err := client.Open(mp)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	hint := func(rows []uint64) (lookups, skipped, reads uint64) {
		t.Helper()
		before := d.Stats(t)
		if err := h.Decode(0, rows); err != nil {
			t.Fatal(err)
		}
		st, err := h.Barrier()
		if err != nil || st.Failed != 0 || st.Resident != st.Pages {
			t.Fatalf("barrier %+v, %v", st, err)
		}
		after := d.Stats(t)
		return after.PrefetchResidencyLookups - before.PrefetchResidencyLookups,
			after.PrefetchResidencySkipped - before.PrefetchResidencySkipped,
			after.BackingReads - before.BackingReads
	}
	lookups, skipped, reads := hint(never)
	if lookups == 0 || skipped != lookups || reads == 0 {
		t.Errorf("after a restart, a hint of rows nobody read: %d residency lookups, %d answered without mincore, %d backing reads; want all of them answered without it, and reads",
			lookups, skipped, reads)
	}
	if err := allResident(t, maps, faulted); err != nil {
		return fmt.Errorf("rows faulted in before the restart: %w", err)
	}
	lookups, skipped, reads = hint(faulted)
	if lookups == 0 || skipped != 0 || reads != 0 {
		return fmt.Errorf("after a restart, a hint of rows faulted in before it: %d lookups, %d without mincore, %d backing reads; want some, 0, 0", lookups, skipped, reads)
	}
	return nil
}

// TestCrashTakeoverHinterReopens: a hint handle the crashed daemon alone
// knew is an orphan for its successor, which answers it EBADF; the Go
// client reopens the control file once and sends the frame again, so an
// engine's Hinter keeps working across a crash without a word: its next
// step's hints and barrier succeed, and the rows are resident after it.
func TestCrashTakeoverHinterReopens(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	dir := Synth(t, spec)
	m := Model(t, dir)
	var h *client.Hinter
	var watchdog *time.Timer
	mp, log := crashTakeover(t, dir, []string{"--cache-size=8MiB"}, func(mp string) {
		// Were a close to wait for the dead daemon again (FLUSH), starting
		// the successor from this process would never return, nor would
		// this process exit: after a minute, abort the connection so that
		// the test fails instead.
		var st unix.Stat_t
		if err := unix.Stat(mp, &st); err != nil {
			t.Fatal(err)
		}
		watchdog = time.AfterFunc(time.Minute, func() {
			p := fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", unix.Minor(st.Dev))
			_ = os.WriteFile(p, []byte("1"), 0)
		})
		var err error
		if h, err = client.Open(mp); err != nil {
			t.Fatal(err)
		}
		if err := h.Decode(0, []uint64{1, 2, 3}); err != nil {
			t.Fatal(err)
		}
		if st, err := h.Barrier(); err != nil || st.Failed != 0 {
			t.Fatalf("before the crash: barrier %+v, %v", st, err)
		}
	})
	if !watchdog.Stop() {
		t.Fatal("starting the successor took a minute: a close of a hint handle waited for the dead daemon (the connection was aborted)")
	}
	defer h.Close() // before the successor stops (crashTakeover's cleanup)
	rows := []uint64{100, 500, 900}
	if err := h.Decode(0, rows); err != nil {
		t.Fatalf("the first hint after the crash: %v\nthe successor's log:\n%s", err, log.String())
	}
	st, err := h.Barrier()
	if err != nil || st.Failed != 0 || st.Pages == 0 || st.Resident != st.Pages {
		t.Fatalf("the first barrier after the crash: %+v, %v\nthe successor's log:\n%s", st, err, log.String())
	}
	tbs := m.LayerTables(0)
	maps := map[*backing.Table][]byte{}
	for _, tb := range tbs {
		f, err := os.Open(filepath.Join(mp, tb.Path()))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b, err := unix.Mmap(int(f.Fd()), 0, int(tb.FileSize), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(b)
		maps[tb] = b
	}
	untilNoOutsideDrop(t, "rows hinted after the crash", func() error { return allResident(t, maps, rows) })
}

// TestCrashTakeoverPythonHinterReopens is TestCrashTakeoverHinterReopens
// for the Python client, in a process of its own that holds its hint
// handle across the crash: its first wait after the takeover gets EBADF
// (the successor never opened that handle) and reopens, and the hints it
// sends next are served and resident at their wait.
func TestCrashTakeoverPythonHinterReopens(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	dir := Synth(t, spec)
	const script = `
import json, sys
sys.path.insert(0, "../hints/python")
import engramfs_hints as eh
h = eh.Hinter(sys.argv[1])
h.decode(0, [1, 2, 3])
s = h.wait()
print("BEFORE", json.dumps(s), flush=True)
sys.stdin.readline()  # the daemon is killed and taken over meanwhile
h.wait()              # EBADF: reopens
h.decode(0, [100, 500, 900])
print("AFTER", json.dumps(h.wait()), flush=True)
h.close()
`
	var py *exec.Cmd
	var stdin io.WriteCloser
	out := &syncBuffer{}
	mp, log := crashTakeover(t, dir, []string{"--cache-size=8MiB"}, func(mp string) {
		py = exec.Command("/usr/bin/python3", "-B", "-c", script, mp)
		py.Stdout, py.Stderr = out, out
		var err error
		if stdin, err = py.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		if err := py.Start(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the Python client's first barrier", func() bool { return strings.Contains(out.String(), "BEFORE") })
	})
	defer func() { _ = py.Process.Kill() }() // before the successor stops, if the test failed
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- py.Wait() }()
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("the Python client after the takeover: %v\n%s\nthe successor's log:\n%s", err, out.String(), log.String())
		}
	case <-time.After(time.Minute):
		t.Fatalf("the Python client did not finish a minute after the takeover (mount %s):\n%s", mp, out.String())
	}
	_, after, ok := strings.Cut(out.String(), "AFTER ")
	var st struct{ Pages, Resident, Failed int }
	if !ok || json.Unmarshal([]byte(strings.TrimSpace(after)), &st) != nil {
		t.Fatalf("no barrier after the takeover in the client's output:\n%s", out.String())
	}
	t.Logf("the client: %s", out.String())
	if st.Pages == 0 || st.Resident != st.Pages || st.Failed != 0 {
		t.Fatalf("the first barrier after the takeover: %+v (want every hinted page resident)\n%s", st, out.String())
	}
}
