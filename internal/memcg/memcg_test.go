package memcg

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/internal/procfs"
)

const testPrefix = "engramfs-memcg-test"

// newGroup makes a group for t, or skips where this machine has none (not
// root, no memory controller); the error says which.
func newGroup(t *testing.T, limit int64) *Group {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("memory cgroups need root")
	}
	g, err := New(testPrefix, limit)
	if err != nil {
		t.Skipf("%v", err)
	}
	t.Cleanup(func() {
		if err := g.Remove(); err != nil {
			t.Error(err)
		}
		if _, err := os.Stat(g.Dir); !os.IsNotExist(err) {
			t.Errorf("%s left behind (%v)", g.Dir, err)
		}
	})
	return g
}

// inGroup reports whether pid's cgroup (of g's version) is g.
func inGroup(t *testing.T, g *Group, pid int) bool {
	t.Helper()
	b, err := os.ReadFile(procfs.PidPath(pid, "cgroup"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), "/"+filepath.Base(g.Dir)+"\n")
}

// TestGroupHoldsProcessesUnderItsLimit: a command started through the
// wrapper runs inside the group, a process added later moves in, the
// limit is the one asked for, a page cache larger than it stays under it,
// and Remove takes the group away with processes still in it.
func TestGroupHoldsProcessesUnderItsLimit(t *testing.T) {
	const limit = 48 << 20
	g := newGroup(t, limit)
	u, err := g.Usage()
	if err != nil {
		t.Fatal(err)
	}
	if u.Limit != limit {
		t.Errorf("limit %d, want %d", u.Limit, limit)
	}

	// 128 MiB written through the page cache inside a 48 MiB group: the
	// group reclaims its own pages, so its usage never passes the limit.
	file := filepath.Join(t.TempDir(), "big")
	dd := exec.Command("dd", "if=/dev/zero", "of="+file, "bs=1M", "count=128", "status=none")
	dd.Args = append(g.Wrapper(), dd.Args...)
	dd.Path = dd.Args[0]
	if out, err := dd.CombinedOutput(); err != nil {
		t.Fatalf("dd in the group: %v\n%s", err, out)
	}
	if u, err = g.Usage(); err != nil {
		t.Fatal(err)
	}
	// Read the file back: its first pages were evicted to make room for
	// the last, so reading them again is a refault of the group's.
	reread := exec.Command("dd", "if="+file, "of=/dev/null", "bs=1M", "status=none")
	reread.Args = append(g.Wrapper(), reread.Args...)
	reread.Path = reread.Args[0]
	if out, err := reread.CombinedOutput(); err != nil {
		t.Fatalf("reading it again in the group: %v\n%s", err, out)
	}
	refaults := u.Refaults
	if u, err = g.Usage(); err != nil {
		t.Fatal(err)
	}
	if u.Refaults <= refaults {
		t.Errorf("reading evicted pages again: refaults %d -> %d, want more", refaults, u.Refaults)
	}
	if u.Peak > limit || (g.Version == 1 && u.Peak < 16<<20) || u.File < 16<<20 {
		t.Errorf("after 128 MiB of page cache: %+v, want the pages charged to the group (over 16 MiB) and its peak within %d", u, limit)
	}

	sleeper := func(wrapped bool) *exec.Cmd {
		args := []string{"sleep", "60"}
		if wrapped {
			args = append(g.Wrapper(), args...)
		}
		c := exec.Command(args[0], args[1:]...)
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		return c
	}
	in := sleeper(true)
	out := sleeper(false)
	// The shell moves itself in before it execs sleep: wait for that.
	for deadline := time.Now().Add(10 * time.Second); !inGroup(t, g, in.Process.Pid) && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if !inGroup(t, g, in.Process.Pid) {
		t.Errorf("a command run through the wrapper is not in %s", g.Dir)
	}
	if inGroup(t, g, out.Process.Pid) {
		t.Fatalf("a process started outside is in %s", g.Dir)
	}
	if err := g.Add(out.Process.Pid); err != nil {
		t.Fatal(err)
	}
	pids, err := g.Procs()
	if err != nil || len(pids) != 2 || !inGroup(t, g, out.Process.Pid) {
		t.Errorf("procs %v (%v), want the wrapped and the added sleeper", pids, err)
	}

	// Remove with both still running: they go back, the group goes.
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(g.Dir); !os.IsNotExist(err) {
		t.Errorf("%s still there after Remove (%v)", g.Dir, err)
	}
	for _, c := range []*exec.Cmd{in, out} {
		if !procfs.Alive(c.Process.Pid) {
			t.Errorf("pid %d died with its group", c.Process.Pid)
		}
	}
}

// TestNewRemovesStaleGroups: a group of a process that is gone (a run
// killed before its cleanup) is removed by the next New; one of a live
// process is not.
func TestNewRemovesStaleGroups(t *testing.T) {
	g := newGroup(t, 16<<20)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(g.parent, fmt.Sprintf("%s-%d-0", testPrefix, dead.Process.Pid))
	live := filepath.Join(g.parent, fmt.Sprintf("%s-%d-0", testPrefix, os.Getppid()))
	for _, d := range []string{stale, live} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Rmdir(d) })
	}
	g2 := newGroup(t, 16<<20)
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("the stale group %s is still there", stale)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("the group of a live process went: %v", err)
	}
	if g2.Dir == g.Dir {
		t.Errorf("two groups share %s", g.Dir)
	}
}

// TestFind picks the hierarchy from the mount table and /proc/self/cgroup:
// v2 when its children can have the memory controller, else v1's memory
// hierarchy, with a cgroup namespace's mount root taken off the path; and
// says why when there is neither.
func TestFind(t *testing.T) {
	v1 := procfs.Mount{Point: "/sys/fs/cgroup/memory", FSType: "cgroup", Root: "/", Options: "rw,memory"}
	self := "4:memory:/process_api/abc\n0::/user.slice/s\n"
	h, err := find([]procfs.Mount{{Point: "/sys/fs/cgroup/cpu", FSType: "cgroup", Root: "/", Options: "rw,cpu"}, v1}, self, "memory", "memory")
	if err != nil || h.version != 1 || h.dir != "/sys/fs/cgroup/memory/process_api/abc" {
		t.Errorf("v1: %+v, %v", h, err)
	}
	ns := v1
	ns.Root = "/process_api"
	if h, err := find([]procfs.Mount{ns}, self, "memory", "memory"); err != nil || h.dir != "/sys/fs/cgroup/memory/abc" {
		t.Errorf("v1 in a cgroup namespace: %+v, %v", h, err)
	}

	// A v2 hierarchy in a temporary directory: its files are plain files.
	root := t.TempDir()
	dir := filepath.Join(root, "user.slice", "s")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	v2 := procfs.Mount{Point: root, FSType: "cgroup2", Root: "/"}
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("cgroup.controllers", "cpu io pids\n")
	write("cgroup.subtree_control", "")
	if h, err := find([]procfs.Mount{v2, v1}, self, "memory", "memory"); err != nil || h.version != 1 {
		t.Errorf("v2 without memory, v1 with it: %+v, %v, want v1", h, err)
	}
	if _, err := find([]procfs.Mount{v2}, self, "memory", "memory"); err == nil || !strings.Contains(err.Error(), "not available") {
		t.Errorf("v2 without memory alone: %v, want why", err)
	}
	write("cgroup.controllers", "cpu memory io\n")
	if h, err := find([]procfs.Mount{v2, v1}, self, "memory", "memory"); err != nil || h.version != 2 || h.dir != dir {
		t.Errorf("v2 with memory: %+v, %v", h, err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control")); string(b) != "+memory" {
		t.Errorf("subtree_control = %q, want memory enabled for the children", b)
	}
	if _, err := find(nil, self, "memory", "memory"); err == nil || !strings.Contains(err.Error(), "no cgroup filesystem") {
		t.Errorf("no cgroup mounted: %v", err)
	}
	if _, err := New(testPrefix, 0); err == nil {
		t.Error("a limit of 0 was taken")
	}
	if s := (&Group{Version: 1, Limit: 5 << 28, Dir: "/x"}).String(); s != "cgroup v1 memory limit 1.25 GiB (/x)" {
		t.Errorf("String() = %q", s)
	}
}

// TestCountIO: the block I/O of the group's processes on the device is
// counted, exactly (no other process is in the group), and a process
// outside the group adds nothing.
func TestCountIO(t *testing.T) {
	g := newGroup(t, 64<<20)
	dir := t.TempDir()
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	if err := g.CountIO(unix.Major(st.Dev), unix.Minor(st.Dev)); err != nil {
		t.Skipf("%v", err)
	}
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	read := func(inside bool) {
		args := []string{"dd", "if=" + file, "of=/dev/null", "bs=64k", "iflag=direct", "status=none"}
		if inside {
			args = append(g.Wrapper(), args...)
		}
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("dd: %v\n%s", err, out)
		}
	}
	read(false)
	c, err := g.IO()
	if err != nil || c != (IOCounters{}) {
		t.Fatalf("before any read inside: %+v, %v", c, err)
	}
	read(true)
	if c, err = g.IO(); err != nil || c.Bytes != 1<<20 || c.Reads < 16 {
		t.Errorf("1 MiB read as 16 O_DIRECT reads of 64 KiB inside: %+v, %v", c, err)
	}
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(g.io); !os.IsNotExist(err) {
		t.Errorf("%s left behind", g.io)
	}
}

// TestOwned lists the groups this process made and still has, in both
// hierarchies, and none once they are removed.
func TestOwned(t *testing.T) {
	g := newGroup(t, 16<<20)
	var st unix.Stat_t
	if err := unix.Stat(t.TempDir(), &st); err != nil {
		t.Fatal(err)
	}
	counted := g.CountIO(unix.Major(st.Dev), unix.Minor(st.Dev)) == nil
	got, err := Owned(testPrefix)
	if err != nil {
		t.Fatal(err)
	}
	want := 1
	if counted && g.io != g.Dir {
		want = 2
	}
	if len(got) != want || got[0] != g.Dir {
		t.Errorf("owned %v, want %s (and its blkio group: %v)", got, g.Dir, counted)
	}
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	if got, _ := Owned(testPrefix); len(got) != 0 {
		t.Errorf("after Remove: %v", got)
	}
}
