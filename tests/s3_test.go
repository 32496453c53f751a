package tests

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/s3source/s3test"
)

// s3Model uploads a synthetic model to a fresh versitygw and mounts
// s3://models/dsv41 from it. It returns the mount and the local copy.
func s3Model(t *testing.T, spec backing.SynthSpec, args ...string) (*Daemon, string, *s3test.Server) {
	t.Helper()
	RequireFUSE(t)
	srv := s3test.Start(t)
	srv.Env(t) // the daemon inherits the credentials
	srv.Bucket(t, "models")
	dir := Synth(t, spec)
	url := srv.Upload(t, dir, "models", "dsv41")
	d := Mount(t, url, append([]string{"--s3-endpoint", srv.Endpoint}, args...)...)
	return d, dir, srv
}

// A model in an object store mounts and reads byte-exact, through read(2)
// and through cold random faults, and a cold page costs one 4 KiB GET: no
// readahead, no 1 MiB blocks.
func TestS3MountReadsTheShards(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Rows = 2048
	d, dir, _ := s3Model(t, spec, "--cache-size", "0")
	m := Model(t, dir)
	tb := m.LayerTables(1)[1] // layer 1's weight table: a page a row
	want := ShardTable(t, dir, tb.Name)
	mp := mapFile(t, filepath.Join(d.Mountpoint, tb.Path()))
	if err := unix.Madvise(mp, unix.MADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	before := d.Stats(t)
	rng := rand.New(rand.NewPCG(9, 10))
	pages := map[int]bool{}
	hdr := len(tb.FileHeader)
	for i := 0; i < 300; i++ {
		row := rng.IntN(int(tb.Rows))
		off := hdr + row*int(tb.RowBytes)
		for b := 0; b < int(tb.RowBytes); b += 997 {
			if got := Touch(mp, off+b); got != want[off-hdr+b] {
				t.Fatalf("row %d byte %d: %#x, want %#x", row, b, got, want[off-hdr+b])
			}
		}
		for p := off / 4096; p <= (off+int(tb.RowBytes)-1)/4096; p++ {
			pages[p] = true
		}
	}
	after := d.Stats(t)
	gets, bytesGot := after.S3Gets-before.S3Gets, after.S3GetBytes-before.S3GetBytes
	ratio := float64(bytesGot) / float64(len(pages)*4096)
	t.Logf("%d distinct cold pages: %d GETs (%d hedges, %d retries), %d bytes: %.3f object-store bytes per page byte",
		len(pages), gets, after.S3Hedges-before.S3Hedges, after.S3Retries-before.S3Retries, bytesGot, ratio)
	if ratio > 1.25 || gets == 0 {
		t.Errorf("%.3f object-store bytes per cold page byte, want at most 1.25", ratio)
	}

	// Every table whole, through read(2).
	for _, tb := range m.Tables {
		got, err := os.ReadFile(filepath.Join(d.Mountpoint, tb.Path()))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[len(tb.FileHeader):], ShardTable(t, dir, tb.Name)) {
			t.Fatalf("%s: bytes differ from the shard", tb.Path())
		}
	}
}

// A shard rewritten in the object store under a live mount: cold pages of
// it fail with EIO (the GET is conditional on the ETag seen at mount),
// never new bytes.
func TestS3RewriteUnderMountGivesEIO(t *testing.T) {
	spec := backing.DefaultSynth()
	spec.Rows = 1024
	d, dir, srv := s3Model(t, spec, "--cache-size", "0")
	m := Model(t, dir)
	tb := m.Tables[0]
	want := ShardTable(t, dir, tb.Name)
	f, err := os.Open(filepath.Join(d.Mountpoint, tb.Path()))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	hdr := int64(len(tb.FileHeader))
	buf := make([]byte, 4096)
	if _, err := f.ReadAt(buf, hdr); err != nil || !bytes.Equal(buf, want[:4096]) {
		t.Fatalf("first page before the rewrite: %v", err)
	}
	shard, err := os.ReadFile(filepath.Join(dir, tb.Shard.Name))
	if err != nil {
		t.Fatal(err)
	}
	for i := range shard {
		shard[i] ^= 0x3C
	}
	srv.Put(t, "models", "dsv41/"+tb.Shard.Name, shard)
	// A page never read before: not in the page cache, so it goes to the store.
	off := hdr + tb.DataLen/2/4096*4096
	n, err := f.ReadAt(buf, off)
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("cold page after the rewrite: %d bytes, %v; want EIO (new bytes: %v)", n, err,
			bytes.Equal(buf[:n], shard[tb.DataStart+off-hdr:][:n]))
	}
	if st := d.Stats(t); st.S3ETagFailures == 0 {
		t.Errorf("stats: s3_etag_failures 0 after a rewrite")
	}
}
