package tests

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
)

// runMount runs `engramfs mount` and expects it to refuse: non-zero exit,
// and a message naming each of want.
func expectMountRefused(t *testing.T, modelDir, mp string, want ...string) {
	t.Helper()
	expectMountRefusedWith(t, nil, nil, modelDir, mp, want...)
}

// expectMountRefusedWith is expectMountRefused with flags of mount, run
// through wrapper (a command that ends by exec'ing the rest) when set.
func expectMountRefusedWith(t *testing.T, wrapper, flags []string, modelDir, mp string, want ...string) {
	t.Helper()
	args := append(append(append(append([]string(nil), wrapper...), Binary(t), "mount"), flags...), modelDir, mp)
	cmd := exec.Command(args[0], args[1:]...)
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		_ = syscall.Unmount(mp, syscall.MNT_DETACH)
		t.Fatalf("engramfs mount %s did not refuse (it mounted?):\n%s", modelDir, out)
	}
	if err == nil {
		t.Fatalf("engramfs mount %s exited 0, want a refusal", modelDir)
	}
	for _, w := range want {
		if !strings.Contains(string(out), w) {
			t.Errorf("refusal does not mention %q:\n%s", w, out)
		}
	}
	if Mounted(mp) {
		_ = syscall.Unmount(mp, syscall.MNT_DETACH)
		t.Errorf("%s was left mounted", mp)
	}
}

func TestBrokenModelsAreRefused(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 64
	shard1 := "model-00001-of-00002.safetensors"
	cases := []struct {
		name   string
		break_ func(t *testing.T, dir string)
		want   []string
	}{
		{"truncated header", func(t *testing.T, dir string) {
			p := filepath.Join(dir, shard1)
			b, _ := os.ReadFile(p)
			n := binary.LittleEndian.Uint64(b)
			writeFile(t, p, b[:8+n/2])
		}, []string{shard1, "runs past the end"}},
		{"header length past the end", func(t *testing.T, dir string) {
			p := filepath.Join(dir, shard1)
			b, _ := os.ReadFile(p)
			binary.LittleEndian.PutUint64(b, uint64(len(b)))
			writeFile(t, p, b)
		}, []string{shard1, "header length"}},
		{"data past the end", func(t *testing.T, dir string) {
			p := filepath.Join(dir, shard1)
			b, _ := os.ReadFile(p)
			writeFile(t, p, b[:len(b)-100])
		}, []string{shard1, "past the end of the data"}},
		{"missing shard", func(t *testing.T, dir string) {
			if err := os.Remove(filepath.Join(dir, shard1)); err != nil {
				t.Fatal(err)
			}
		}, []string{shard1, "no such file"}},
		{"shard outside the model directory", func(t *testing.T, dir string) {
			p := filepath.Join(dir, backing.IndexFile)
			b, _ := os.ReadFile(p)
			writeFile(t, p, []byte(strings.ReplaceAll(string(b), shard1, "../"+shard1)))
		}, []string{backing.IndexFile, "leaves the model directory"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := Synth(t, spec)
			c.break_(t, dir)
			mp := filepath.Join(t.TempDir(), "mnt")
			if err := os.Mkdir(mp, 0o755); err != nil {
				t.Fatal(err)
			}
			expectMountRefused(t, dir, mp, c.want...)
		})
	}
	t.Run("layers with different row counts", func(t *testing.T) {
		a, b := spec, spec
		b.Rows = spec.Rows + 1
		dirA, dirB := Synth(t, a), Synth(t, b)
		// Layer 1 from a model with another row count: its weight and
		// scale still agree, so mix weight of one with scale of the other.
		mixed := filepath.Join(t.TempDir(), "mixed")
		if err := os.Mkdir(mixed, 0o755); err != nil {
			t.Fatal(err)
		}
		hdrA := tensorHeaders(t, filepath.Join(dirA, shard1))
		hdrB := tensorHeaders(t, filepath.Join(dirB, shard1))
		wName, sName := "layers.0.engram.embed.weight", "layers.0.engram.embed.scale"
		tensors := []backing.TensorInfo{hdrA[wName], hdrB[sName]}
		tensors[1].Begin, tensors[1].End = tensors[0].End, tensors[0].End+(hdrB[sName].End-hdrB[sName].Begin)
		h, err := backing.EncodeHeader(tensors, nil, 1)
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(mixed, "only.safetensors"), append(h, make([]byte, tensors[1].End)...))
		mp := filepath.Join(t.TempDir(), "mnt")
		if err := os.Mkdir(mp, 0o755); err != nil {
			t.Fatal(err)
		}
		expectMountRefused(t, mixed, mp, "only.safetensors", "rows")
	})
}

func tensorHeaders(t *testing.T, path string) map[string]backing.TensorInfo {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	h, err := backing.ReadHeader(f, fi.Size())
	if err != nil {
		t.Fatal(err)
	}
	return h.Tensors
}

func writeFile(t *testing.T, p string, b []byte) {
	t.Helper()
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestUnusableMountpointIsRefused(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 64
	dir := Synth(t, spec)
	expectMountRefused(t, dir, filepath.Join(t.TempDir(), "missing"), "missing", "no such file")
	file := filepath.Join(t.TempDir(), "file")
	writeFile(t, file, nil)
	expectMountRefused(t, dir, file, file, "not a directory")
}

// A stop while a process maps a table waits for the mapping to go (its next
// cold page would be SIGBUS once the daemon is gone), naming the pid: once
// the reader unmaps (SIGTERM), the daemon unmounts cleanly; a second signal
// (SIGINT twice) stops at once, detaching the busy mount.
func TestSignalWithAMappedReaderWaits(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			spec := backing.DefaultSynth()
			spec.Rows = 256
			d := Mount(t, Synth(t, spec))
			f, err := os.Open(filepath.Join(d.Mountpoint, "layers", "0", "weight.safetensors"))
			if err != nil {
				t.Fatal(err)
			}
			m, err := unix.Mmap(int(f.Fd()), 0, 8192, unix.PROT_READ, unix.MAP_SHARED)
			f.Close() // the mapping alone keeps the file
			if err != nil {
				t.Fatal(err)
			}
			unmapped := false
			defer func() {
				if !unmapped {
					_ = unix.Munmap(m)
				}
			}()
			Touch(m, 4096)
			if err := d.Signal(sig); err != nil {
				t.Fatal(err)
			}
			waiting := fmt.Sprintf(`"pids": [%d]`, os.Getpid())
			waitFor(t, "the daemon to say it waits for this process's mapping", func() bool {
				return strings.Contains(d.Log(), "waiting for processes that map table files") && strings.Contains(d.Log(), waiting)
			})
			select {
			case <-d.Exited():
				t.Fatalf("the daemon exited while a reader maps a table\n%s", d.Log())
			default:
			}
			if sig == syscall.SIGTERM {
				if err := unix.Munmap(m); err != nil {
					t.Fatal(err)
				}
				unmapped = true
			} else if err := d.Signal(sig); err != nil {
				t.Fatal(err)
			}
			select {
			case <-d.Exited():
			case <-time.After(30 * time.Second):
				t.Fatalf("daemon did not exit within 30 s\n%s", d.Log())
			}
			if err := d.ExitErr(); err != nil {
				t.Fatalf("daemon exited with %v\n%s", err, d.Log())
			}
			if Mounted(d.Mountpoint) {
				t.Fatalf("%s still mounted", d.Mountpoint)
			}
			detached := strings.Contains(d.Log(), "detached")
			if sig == syscall.SIGTERM && detached {
				t.Errorf("the mapping was gone, yet the daemon detached the mount lazily:\n%s", d.Log())
			}
			if sig == syscall.SIGINT && !detached {
				t.Errorf("forced by a second signal, the daemon did not say it detached the busy mount:\n%s", d.Log())
			}
		})
	}
}

func TestUnmountCommand(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Rows = 64
	d := Mount(t, Synth(t, spec))
	out, err := exec.Command(Binary(t), "unmount", d.Mountpoint).CombinedOutput()
	if err != nil {
		t.Fatalf("engramfs unmount: %v\n%s", err, out)
	}
	select {
	case <-d.Exited():
	case <-time.After(10 * time.Second):
		t.Fatalf("daemon did not exit after its mount was unmounted\n%s", d.Log())
	}
	if err := d.ExitErr(); err != nil {
		t.Fatalf("daemon exited with %v", err)
	}
	out, err = exec.Command(Binary(t), "unmount", d.Mountpoint).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "not a mount point") {
		t.Fatalf("unmount of a non-mount: %v, %s; want a 'not a mount point' error", err, out)
	}
}

// A table name that would leave the mount (a permissive --table-pattern and
// a tensor named layers.0.../../../evil) is refused with the tensor's name:
// mounted, the index and manifest sent loaders to ../evil.safetensors,
// outside the mount, and the daemon opened that file itself.
func TestTableNameOutsideMountIsRefused(t *testing.T) {
	RequireFUSE(t)
	const evil = "layers.0.../../../evil"
	dir := t.TempDir()
	hdr, err := backing.EncodeHeader([]backing.TensorInfo{{Name: evil, Dtype: "U8", Shape: []int64{4, 4096}, Begin: 0, End: 4 * 4096}},
		map[string]string{"format": "pt"}, 1)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "model.safetensors"), append(hdr, make([]byte, 4*4096)...))
	mp := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	// What the name reaches from the daemon's view of the mount.
	writeFile(t, filepath.Join(filepath.Dir(mp), "evil.safetensors"), []byte("outside"))
	expectMountRefusedWith(t, nil, []string{"--table-pattern", `^layers\.(?P<layer>\d+)\.(?P<table>.+)$`}, dir, mp,
		`"`+evil+`"`, "not a file name inside the mount")
}

// mkfifo makes a FIFO at path; nothing ever opens its other end.
func mkfifo(t *testing.T, path string) {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
}

// A FIFO where a shard or the index should be is refused at once, named,
// instead of blocking the mount in open(2) forever (a FIFO opens only once
// a writer comes).
func TestSpecialFilesInTheModelAreRefused(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 64
	t.Run("shard", func(t *testing.T) {
		dir := Synth(t, spec)
		os.Remove(filepath.Join(dir, backing.IndexFile)) // every *.safetensors is a shard
		fifo := filepath.Join(dir, "model-00003-of-00003.safetensors")
		mkfifo(t, fifo)
		expectMountRefused(t, dir, t.TempDir(), fifo, "not a regular file")
	})
	t.Run("index shard", func(t *testing.T) {
		dir := Synth(t, spec)
		shard := filepath.Join(dir, "model-00002-of-00002.safetensors")
		os.Remove(shard)
		mkfifo(t, shard)
		expectMountRefused(t, dir, t.TempDir(), shard, "not a regular file")
	})
	t.Run("index", func(t *testing.T) {
		dir := Synth(t, spec)
		index := filepath.Join(dir, backing.IndexFile)
		os.Remove(index)
		mkfifo(t, index)
		expectMountRefused(t, dir, t.TempDir(), index, "not a regular file")
	})
}

// A FIFO as --state-file is ignored with a warning that names it, and the
// mount is announced ready ("mounted"): it used to serve without ever
// saying so, blocked in open(2) on the state file.
func TestStateFileFIFOIsIgnored(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Rows = 64
	fifo := filepath.Join(t.TempDir(), "warm.state")
	mkfifo(t, fifo)
	d := Mount(t, Synth(t, spec), "--state-file", fifo) // waits for "mounted"
	var warned bool
	for _, line := range strings.Split(d.Log(), "\n") {
		warned = warned || strings.Contains(line, "WARN") && strings.Contains(line, fifo) && strings.Contains(line, "not a regular file")
	}
	if !warned {
		t.Errorf("no warning naming the FIFO state file:\n%s", d.Summary())
	}
}

// withNoFile is a wrapper that runs a command with RLIMIT_NOFILE n.
func withNoFile(n int) []string {
	return []string{"sh", "-c", fmt.Sprintf(`ulimit -n %d && exec "$@"`, n), "sh"}
}

// A descriptor limit too low to start is refused with a message that gives
// the limit, not a panic of go-fuse's splice init (RLIMIT_NOFILE 8); one
// too low for the model is refused once the tables are counted, before the
// tree and the mount are built, with what the model needs (a 100K-table
// model spent 35 s of CPU and 870 MB before it failed at the table files).
func TestDescriptorLimitIsChecked(t *testing.T) {
	RequireFUSE(t)
	spec := backing.DefaultSynth()
	spec.Rows = 64
	spec.Layers = 20 // 40 tables
	dir := Synth(t, spec)
	mp := t.TempDir()
	t.Run("8", func(t *testing.T) {
		expectMountRefusedWith(t, withNoFile(8), nil, dir, mp, "RLIMIT_NOFILE is 8", "ulimit -n")
	})
	t.Run("64", func(t *testing.T) {
		expectMountRefusedWith(t, withNoFile(64), nil, dir, mp, "RLIMIT_NOFILE is 64", "40 tables", "ulimit -n")
	})
	t.Run("enough", func(t *testing.T) {
		d := MountWrapped(t, withNoFile(512), dir)
		m := Model(t, dir)
		tb := m.Tables[len(m.Tables)-1]
		got, err := os.ReadFile(filepath.Join(d.Mountpoint, tb.Path()))
		if err != nil || !bytes.Equal(got[len(tb.FileHeader):], ShardTable(t, dir, tb.Name)) {
			t.Fatalf("%s under RLIMIT_NOFILE 512: %v, or wrong bytes", tb.Path(), err)
		}
	})
}
