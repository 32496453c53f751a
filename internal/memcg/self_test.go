package memcg

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/engramfs/engramfs/internal/procfs"
)

// tree writes files (path relative to root: content) under root.
func tree(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, s := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestOwnLimitV2: the tightest of memory.max and memory.high on the group
// and its ancestors, "max" meaning none, and the root (no files) none.
func TestOwnLimitV2(t *testing.T) {
	root := t.TempDir()
	tree(t, root, map[string]string{
		"cgroup.controllers":                           "cpu io memory pids\n",
		"system.slice/memory.max":                      "max\n",
		"system.slice/memory.high":                     "max\n",
		"system.slice/engramfs.service/memory.max":     "268435456\n",
		"system.slice/engramfs.service/memory.high":    "max\n",
		"system.slice/engramfs.service/d/memory.max":   "max\n",
		"system.slice/engramfs.service/d/memory.high":  "max\n",
		"system.slice/other.service/memory.max":        "1024\n",
		"system.slice/engramfs.service/d/memory.stat":  "",
		"system.slice/engramfs.service/d/cgroup.procs": "",
	})
	mounts := []procfs.Mount{{Point: root, FSType: "cgroup2", Root: "/"}}
	s, err := own(mounts, "0::/system.slice/engramfs.service/d\n")
	if err != nil || s.Version != 2 || s.Dir != filepath.Join(root, "system.slice/engramfs.service/d") || s.Root != root {
		t.Fatalf("own: %+v, %v", s, err)
	}
	if g := s.Groups(); len(g) != 4 || g[0] != s.Dir || g[3] != root {
		t.Errorf("groups %v, want the group, two ancestors and the root", g)
	}
	l, err := s.Limit()
	if err != nil || l.Bytes != 256<<20 || l.File != "memory.max" || l.Dir != filepath.Join(root, "system.slice/engramfs.service") {
		t.Errorf("limit %+v, %v: want the service's memory.max (a sibling's smaller limit holds nobody here)", l, err)
	}
	// memory.high below memory.max: the group stalls in reclaim there.
	tree(t, root, map[string]string{"system.slice/memory.high": "201326592\n"})
	if l, err = s.Limit(); err != nil || l.Bytes != 192<<20 || l.File != "memory.high" || l.Dir != filepath.Join(root, "system.slice") {
		t.Errorf("with a parent's memory.high at 192 MiB: %+v, %v", l, err)
	}
	tree(t, root, map[string]string{"system.slice/memory.high": "lots\n"})
	if _, err = s.Limit(); err == nil || !strings.Contains(err.Error(), "lots") {
		t.Errorf("a limit file that holds no number: %v, want an error naming it", err)
	}
	// No limit anywhere.
	r2 := t.TempDir()
	tree(t, r2, map[string]string{"cgroup.controllers": "memory\n", "a/memory.max": "max\n"})
	s2, err := own([]procfs.Mount{{Point: r2, FSType: "cgroup2", Root: "/"}}, "0::/a\n")
	if err != nil {
		t.Fatal(err)
	}
	if l, err := s2.Limit(); err != nil || l.Bytes != 0 {
		t.Errorf("no limit: %+v, %v", l, err)
	}
}

// TestOwnLimitV1: a hybrid setup (the unified hierarchy without the memory
// controller) uses v1's memory hierarchy, in a cgroup namespace too; v1's
// "no limit" is its page counter's maximum.
func TestOwnLimitV1(t *testing.T) {
	unified, v1 := t.TempDir(), t.TempDir()
	tree(t, unified, map[string]string{"cgroup.controllers": "cpu io\n"})
	tree(t, v1, map[string]string{
		"memory.limit_in_bytes":                          "9223372036854771712\n",
		"process_api/memory.limit_in_bytes":              "9223372036854771712\n",
		"process_api/abc/memory.limit_in_bytes":          "536870912\n",
		"process_api/abc/engramfs/memory.limit_in_bytes": "268435456\n",
	})
	mounts := []procfs.Mount{
		{Point: unified, FSType: "cgroup2", Root: "/"},
		{Point: "/nowhere/cpu", FSType: "cgroup", Root: "/", Options: "rw,cpu"},
		{Point: v1, FSType: "cgroup", Root: "/", Options: "rw,memory"},
	}
	self := "4:memory:/process_api/abc/engramfs\n1:cpu:/\n0::/\n"
	s, err := own(mounts, self)
	if err != nil || s.Version != 1 || s.Dir != filepath.Join(v1, "process_api/abc/engramfs") {
		t.Fatalf("own: %+v, %v", s, err)
	}
	if l, err := s.Limit(); err != nil || l.Bytes != 256<<20 || l.File != "memory.limit_in_bytes" {
		t.Errorf("limit %+v, %v", l, err)
	}
	// In a cgroup namespace the mount's root is the namespace's group.
	ns := mounts[2]
	ns.Point, ns.Root = filepath.Join(v1, "process_api"), "/process_api"
	s, err = own([]procfs.Mount{ns}, self)
	if err != nil || s.Dir != filepath.Join(v1, "process_api/abc/engramfs") || len(s.Groups()) != 3 {
		t.Fatalf("in a namespace: %+v (groups %v), %v", s, s.Groups(), err)
	}
	if l, err := s.Limit(); err != nil || l.Bytes != 256<<20 {
		t.Errorf("in a namespace: limit %+v, %v", l, err)
	}
	// Inodes name the group and its ancestors, as the filesystem does.
	ino, err := s.Inodes()
	if err != nil || len(ino) != 3 {
		t.Fatalf("inodes %v, %v", ino, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(s.Dir, &st); err != nil || ino[0] != st.Ino {
		t.Errorf("inode of the group %d, want %d (%v)", ino[0], st.Ino, err)
	}
	if _, err := own(mounts[:2], self); err == nil || !strings.Contains(err.Error(), "no memory cgroup") {
		t.Errorf("no memory controller anywhere: %v", err)
	}
}

// TestOwnHere reads this process's own group on this machine: whatever it
// is, its limit reads without error, and its inode is the one the kernel
// gives the directory.
func TestOwnHere(t *testing.T) {
	s, err := Own()
	if err != nil {
		t.Skipf("%v", err)
	}
	if _, err := s.Limit(); err != nil {
		t.Errorf("%s: %v", s, err)
	}
	if ino, err := s.Inodes(); err != nil || len(ino) != len(s.Groups()) {
		t.Errorf("%s: inodes %v, %v", s, ino, err)
	}
}
