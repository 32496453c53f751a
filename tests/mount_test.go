package tests

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/testenv"
)

// geometries are the two row shapes that must both work: rows of a page or
// more, and rows many times smaller than a page.
func geometries() map[string]backing.SynthSpec {
	big := backing.DefaultSynth()
	big.Rows = 1500 // weight ~6 MiB, scale rows 32 to a page; not a page multiple
	small := backing.DefaultSynth()
	small.FlashGeometry()
	small.Rows = 20011 // 16 weight rows and 512 scale rows to a page; last page partial
	return map[string]backing.SynthSpec{"4096B": big, "flash": small}
}

func TestEveryByteMatchesTheShards(t *testing.T) {
	for name, spec := range geometries() {
		t.Run(name, func(t *testing.T) {
			d := Mount(t, Synth(t, spec))
			for _, tb := range Model(t, d.ModelDir).Tables {
				want := ShardTable(t, d.ModelDir, tb.Name)
				path := filepath.Join(d.Mountpoint, tb.Path())
				got, err := os.ReadFile(path)
				if err != nil {
					t.Fatal(err)
				}
				if int64(len(got)) != tb.FileSize {
					t.Fatalf("%s: read %d bytes, want file size %d", tb.Path(), len(got), tb.FileSize)
				}
				if !bytes.Equal(got[len(tb.FileHeader):], want) {
					t.Fatalf("%s: data read with read(2) differs from the shard", tb.Path())
				}
				// A fresh mapping: pages already read above come from the page
				// cache, the rest fault through FUSE; both must be right.
				m := testenv.MapFile(t, path)
				if !bytes.Equal(m[len(tb.FileHeader):], want) {
					t.Fatalf("%s: data read through mmap differs from the shard", tb.Path())
				}
			}
		})
	}
}

func TestMmapOnColdMountMatches(t *testing.T) {
	// Random rows through mmap only, so every page faults in cold, in random
	// order, with MADV_RANDOM as readers use it.
	for name, spec := range geometries() {
		t.Run(name, func(t *testing.T) {
			d := Mount(t, Synth(t, spec))
			rng := rand.New(rand.NewPCG(1, 2))
			for _, tb := range Model(t, d.ModelDir).Tables {
				want := ShardTable(t, d.ModelDir, tb.Name)
				m := testenv.MapFile(t, filepath.Join(d.Mountpoint, tb.Path()))
				if err := unix.Madvise(m, unix.MADV_RANDOM); err != nil {
					t.Fatal(err)
				}
				data := m[len(tb.FileHeader):]
				for i := 0; i < 300; i++ {
					r := rng.Uint64N(tb.Rows)
					lo, hi := r*uint64(tb.RowBytes), (r+1)*uint64(tb.RowBytes)
					if !bytes.Equal(data[lo:hi], want[lo:hi]) {
						t.Fatalf("%s row %d differs from the shard", tb.Path(), r)
					}
				}
			}
		})
	}
}

func TestColdFaultCostsOnePage(t *testing.T) {
	for name, spec := range geometries() {
		for _, advice := range []string{"MADV_RANDOM", "no advice"} {
			t.Run(name+"/"+advice, func(t *testing.T) {
				d := Mount(t, Synth(t, spec))
				rng := rand.New(rand.NewPCG(3, 4))
				for _, tb := range Model(t, d.ModelDir).Tables {
					m := testenv.MapFile(t, filepath.Join(d.Mountpoint, tb.Path()))
					if advice == "MADV_RANDOM" {
						if err := unix.Madvise(m, unix.MADV_RANDOM); err != nil {
							t.Fatal(err)
						}
					}
					touched := map[uint64]bool{}
					for i := 0; i < 20; i++ {
						page := tb.DataPage() + rng.Uint64N(tb.Pages()-tb.DataPage())
						if touched[page] {
							continue
						}
						touched[page] = true
						before := d.Stats(t)
						Touch(m, int(page*4096)) // the fault
						after := d.Stats(t)
						reads, bytes := after.FuseReads-before.FuseReads, after.FuseReadBytes-before.FuseReadBytes
						breads, bbytes := after.BackingReads-before.BackingReads, after.BackingBytes-before.BackingBytes
						pageBytes := min(uint64(4096), uint64(tb.FileSize)-page*4096)
						if reads != 1 || bytes != pageBytes {
							t.Fatalf("%s page %d: fault cost %d FUSE reads of %d bytes, want 1 of %d", tb.Path(), page, reads, bytes, pageBytes)
						}
						// One backing read of the page; under O_DIRECT the
						// read is rounded out to the device alignment.
						if breads != 1 || bbytes < pageBytes || bbytes >= pageBytes+4096 {
							t.Fatalf("%s page %d: fault cost %d backing reads of %d bytes, want 1 of one page (%d bytes plus alignment)",
								tb.Path(), page, breads, bbytes, pageBytes)
						}
					}
				}
			})
		}
	}
}

// parseSafetensors reads a safetensors header the way a loader does.
func parseSafetensors(t *testing.T, path string) (map[string]json.RawMessage, int64) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var n uint64
	if err := binary.Read(f, binary.LittleEndian, &n); err != nil {
		t.Fatal(err)
	}
	hdr := make([]byte, n)
	if _, err := f.ReadAt(hdr, 8); err != nil {
		t.Fatal(err)
	}
	var h map[string]json.RawMessage
	if err := json.Unmarshal(hdr, &h); err != nil {
		t.Fatalf("%s: header is not JSON: %v", path, err)
	}
	return h, int64(8 + n)
}

func TestTableFilesAreSafetensorsAndIndexed(t *testing.T) {
	spec := geometries()["4096B"]
	d := Mount(t, Synth(t, spec))
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	b, err := os.ReadFile(filepath.Join(d.Mountpoint, backing.IndexFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &idx); err != nil {
		t.Fatal(err)
	}
	// The tensor that is not a table stays in its shard, which the mount
	// serves at its own path (modeldir_test.go reads it).
	if got, want := idx.WeightMap[backing.UnrelatedTensor], fmt.Sprintf("model-00001-of-%05d.safetensors", spec.Layers); got != want {
		t.Errorf("the index maps %s to %q, want its shard %q", backing.UnrelatedTensor, got, want)
	}
	src := Model(t, d.ModelDir)
	if len(idx.WeightMap) != len(src.Tables)+1 {
		t.Errorf("index maps %d tensors, want the %d tables and %s", len(idx.WeightMap), len(src.Tables), backing.UnrelatedTensor)
	}
	for _, tb := range src.Tables {
		file, ok := idx.WeightMap[tb.Name]
		if !ok {
			t.Fatalf("index does not map %s", tb.Name)
		}
		h, dataStart := parseSafetensors(t, filepath.Join(d.Mountpoint, file))
		if dataStart%4096 != 0 {
			t.Errorf("%s: data starts at %d, not page-aligned", file, dataStart)
		}
		if len(h) != 2 { // the tensor and __metadata__
			t.Errorf("%s: header has %d entries, want the tensor and __metadata__", file, len(h))
		}
		var ti struct {
			Dtype       string  `json:"dtype"`
			Shape       []int64 `json:"shape"`
			DataOffsets []int64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(h[tb.Name], &ti); err != nil {
			t.Fatalf("%s: no tensor %s: %v", file, tb.Name, err)
		}
		size, _ := backing.DtypeSize(ti.Dtype)
		if ti.Dtype != tb.Dtype || len(ti.Shape) != 2 || uint64(ti.Shape[0]) != tb.Rows || ti.Shape[1]*size != tb.RowBytes {
			t.Errorf("%s: tensor %+v does not match the shard's %s %d×%d B", file, ti, tb.Dtype, tb.Rows, tb.RowBytes)
		}
		if ti.DataOffsets[0] != 0 || ti.DataOffsets[1] != tb.DataLen {
			t.Errorf("%s: data_offsets %v, want [0 %d]", file, ti.DataOffsets, tb.DataLen)
		}
		fi, err := os.Stat(filepath.Join(d.Mountpoint, file))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size() != dataStart+tb.DataLen {
			t.Errorf("%s: size %d, want %d", file, fi.Size(), dataStart+tb.DataLen)
		}
	}
	var man struct {
		Layers []struct {
			Layer  int    `json:"layer"`
			Rows   uint64 `json:"rows"`
			Tables []struct {
				File       string `json:"file"`
				DataOffset int64  `json:"data_offset"`
				RowBytes   int64  `json:"row_bytes"`
			} `json:"tables"`
		} `json:"layers"`
	}
	b, err = os.ReadFile(filepath.Join(d.Mountpoint, "manifest.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &man); err != nil {
		t.Fatal(err)
	}
	if len(man.Layers) != spec.Layers {
		t.Fatalf("manifest has %d layers, want %d", len(man.Layers), spec.Layers)
	}
	for _, l := range man.Layers {
		if l.Rows != spec.Rows || len(l.Tables) != 2 {
			t.Errorf("manifest layer %d: %d rows, %d tables; want %d rows, 2 tables", l.Layer, l.Rows, len(l.Tables), spec.Rows)
		}
		for _, tf := range l.Tables {
			if _, err := os.Stat(filepath.Join(d.Mountpoint, tf.File)); err != nil || tf.DataOffset%4096 != 0 {
				t.Errorf("manifest table %+v: file %v, data offset must be page-aligned", tf, err)
			}
		}
	}
}

func TestMutationsFailReadOnly(t *testing.T) {
	d := Mount(t, Synth(t, geometries()["4096B"]))
	mp := d.Mountpoint
	table := filepath.Join(mp, "layers", "0", "weight.safetensors")
	cases := map[string]func() error{
		"write":      func() error { _, err := os.OpenFile(table, os.O_WRONLY, 0); return err },
		"read-write": func() error { _, err := os.OpenFile(table, os.O_RDWR, 0); return err },
		"create":     func() error { _, err := os.Create(filepath.Join(mp, "new")); return err },
		"create in layer": func() error {
			_, err := os.Create(filepath.Join(mp, "layers", "0", "new.safetensors"))
			return err
		},
		"unlink":   func() error { return os.Remove(table) },
		"rmdir":    func() error { return syscall.Rmdir(filepath.Join(mp, "layers", "0")) },
		"mkdir":    func() error { return os.Mkdir(filepath.Join(mp, "d"), 0o755) },
		"rename":   func() error { return os.Rename(table, filepath.Join(mp, "layers", "0", "x")) },
		"truncate": func() error { return os.Truncate(table, 0) },
		"chmod":    func() error { return os.Chmod(table, 0o666) },
		"chown":    func() error { return os.Chown(table, 1, 1) },
		"utimes":   func() error { return os.Chtimes(table, time.Now(), time.Now()) },
		"symlink":  func() error { return os.Symlink(table, filepath.Join(mp, "link")) },
		"link":     func() error { return os.Link(table, filepath.Join(mp, "hard")) },
		"stats write": func() error {
			_, err := os.OpenFile(filepath.Join(mp, ".engramfs", "stats"), os.O_WRONLY, 0)
			return err
		},
		"manifest write": func() error {
			_, err := os.OpenFile(filepath.Join(mp, "manifest.json"), os.O_WRONLY|os.O_TRUNC, 0)
			return err
		},
	}
	for name, op := range cases {
		if err := op(); !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s: got %v, want EROFS", name, err)
		}
	}
	// And the filesystem still serves.
	if _, err := os.ReadFile(filepath.Join(mp, "manifest.json")); err != nil {
		t.Fatal(err)
	}
}

// requireNumpy returns Debian's python3 when it has numpy; without it the
// test skips, or fails where ENGRAMFS_REQUIRE_FUSE=1 (CI installs it).
func requireNumpy(t *testing.T) string {
	t.Helper()
	python := "/usr/bin/python3"
	if err := exec.Command(python, "-c", "import numpy").Run(); err != nil {
		if os.Getenv(testenv.RequireFUSEEnv) == "1" {
			t.Fatalf("%s with numpy is needed (Debian: python3-numpy): %v", python, err)
		}
		t.Skipf("%s with numpy is needed (Debian: python3-numpy): %v", python, err)
	}
	return python
}

func TestPythonLoaderOnTheMount(t *testing.T) {
	python := requireNumpy(t)
	for name, spec := range geometries() {
		t.Run(name, func(t *testing.T) {
			d := Mount(t, Synth(t, spec))
			out, err := exec.Command(python, "python/loader_check.py", d.Mountpoint, d.ModelDir, "400").CombinedOutput()
			if err != nil {
				t.Fatalf("loader_check.py: %v\n%s", err, out)
			}
			if !strings.Contains(string(out), "OK ") {
				t.Fatalf("loader_check.py did not report OK:\n%s", out)
			}
			t.Logf("%s", out)
		})
	}
}
