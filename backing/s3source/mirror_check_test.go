package s3source

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
	"github.com/engramfs/engramfs/internal/testenv"
)

// loggedMirrorSource is mirrorSource with the mirror's log observed.
func loggedMirrorSource(t *testing.T, f *fakeStore, dir string, budget int64) (*Source, *stats.Counters, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := testConfig()
	cfg.Mirror = MirrorConfig{Dir: dir, Size: budget, Log: zap.New(core)}
	st := &stats.Counters{}
	src, err := newSource(f, "bucket", "m/", cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return src, st, logs
}

// fakeMirrorObject is a fake store holding mirrorObject(seed) as mirrorKey.
func fakeMirrorObject(t *testing.T, seed uint64) (*fakeStore, []byte) {
	f := newFakeStore()
	want := mirrorObject(t, seed)
	f.put("m/"+mirrorKey, want)
	return f, want
}

// openMirrored is loggedMirrorSource with mirrorKey opened.
func openMirrored(t *testing.T, f *fakeStore, dir string, budget int64) (*Source, *stats.Counters, backing.ShardFile, *observer.ObservedLogs) {
	t.Helper()
	src, st, logs := loggedMirrorSource(t, f, dir, budget)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	return src, st, sf, logs
}

func mirrorDataPath(dir string) string { return filepath.Join(dir, url.PathEscape(mirrorKey)+".data") }

// Damage between two mounts, as a disk or an operator can do it: random
// bytes over some mirrored pages, holes punched in others. Nothing but the
// object's bytes is served; each damaged page is counted, read from the
// object and mirrored again, and served from the mirror after that, also
// after the next remount.
func TestMirrorDamagedPagesAreFetchedAgain(t *testing.T) {
	f, want := fakeMirrorObject(t, 21)
	dir := t.TempDir()
	src, _, sf, _ := openMirrored(t, f, dir, 64<<20)
	var offs []int64 // a page every 64 KiB: 257 pages, the short last one included
	for off := int64(0); off < int64(len(want)); off += 64 << 10 {
		offs = append(offs, off)
	}
	check(t, sf, want, offs, 1000)
	src.mir.sync()
	closeAll(t, sf, src)

	df, err := os.OpenFile(mirrorDataPath(dir), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(22, 23))
	damaged := 0
	for i, off := range offs {
		switch i % 3 {
		case 0: // random bytes over part of the page
			junk := make([]byte, 1+rng.IntN(4000))
			for j := range junk {
				junk[j] = byte(rng.Uint32())
			}
			if _, err := df.WriteAt(junk, off+int64(rng.IntN(4096-len(junk)+1))); err != nil {
				t.Fatal(err)
			}
			damaged++
		case 1: // a hole
			if err := unix.Fallocate(int(df.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, 4096); err != nil {
				t.Fatal(err)
			}
			damaged++
		}
	}
	df.Close()

	src, st, sf, logs := openMirrored(t, f, dir, 64<<20)
	check(t, sf, want, offs, 1000)
	if got := st.MirrorChecksumFailures.Load(); got != uint64(damaged) {
		t.Errorf("mirror_checksum_failures %d, want the %d damaged pages", got, damaged)
	}
	if got := st.MirrorHits.Load(); got != uint64(len(offs)-damaged) {
		t.Errorf("%d mirror hits, want the %d intact pages", got, len(offs)-damaged)
	}
	if logs.FilterMessageSnippet("checksum").Len() == 0 {
		t.Error("no log line about the damaged pages")
	}
	src.mir.sync() // the damaged pages are mirrored again
	gets := st.S3Gets.Load()
	check(t, sf, want, offs, 1000)
	if st.S3Gets.Load() != gets {
		t.Errorf("%d GETs for pages mirrored again", st.S3Gets.Load()-gets)
	}
	closeAll(t, sf, src)

	src, st, sf, _ = openMirrored(t, f, dir, 64<<20)
	check(t, sf, want, offs, 1000)
	if st.S3Gets.Load() != 0 || st.MirrorChecksumFailures.Load() != 0 {
		t.Errorf("after the repair and a remount: %d GETs, %d checksum failures; want 0 and 0", st.S3Gets.Load(), st.MirrorChecksumFailures.Load())
	}
	closeAll(t, sf, src)
}

// A damaged mirrored header (ReadAt, which model loading uses) is read
// from the object: the intact object is never blamed for the mirror.
func TestMirrorDamagedHeaderIsFetchedAgain(t *testing.T) {
	f, want := fakeMirrorObject(t, 24)
	dir := t.TempDir()
	src, _, sf, _ := openMirrored(t, f, dir, 64<<20)
	hdr := make([]byte, 6000)
	if _, err := sf.ReadAt(hdr, 8); err != nil {
		t.Fatal(err)
	}
	src.mir.sync()
	closeAll(t, sf, src)
	df, err := os.OpenFile(mirrorDataPath(dir), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := df.WriteAt(bytes.Repeat([]byte{0x5A}, 16), 4096+100); err != nil {
		t.Fatal(err)
	}
	df.Close()
	src, st, sf, _ := openMirrored(t, f, dir, 64<<20)
	if n, err := sf.ReadAt(hdr, 8); err != nil || n != len(hdr) || !bytes.Equal(hdr, want[8:8+len(hdr)]) {
		t.Fatalf("ReadAt over a damaged mirrored page: %d, %v, or wrong bytes", n, err)
	}
	if st.MirrorChecksumFailures.Load() != 1 || st.S3Gets.Load() != 1 {
		t.Errorf("%d checksum failures, %d GETs; want 1 and 1", st.MirrorChecksumFailures.Load(), st.S3Gets.Load())
	}
	closeAll(t, sf, src)
}

// A mirror written before pages had checksums (format EGMIRR01) is
// discarded, with a log line: its bytes cannot be checked.
func TestMirrorOldFormatIsDiscarded(t *testing.T) {
	f, want := fakeMirrorObject(t, 25)
	_, etag, _ := f.Head(context.Background(), "m/"+mirrorKey)
	dir := t.TempDir()
	pages := (int64(len(want)) + mirrorPage - 1) / mirrorPage
	meta := make([]byte, mirrorHeader+8*((pages+63)/64))
	copy(meta, "EGMIRR01")
	binary.LittleEndian.PutUint32(meta[8:], mirrorPage)
	binary.LittleEndian.PutUint32(meta[12:], uint32(len(etag)))
	binary.LittleEndian.PutUint64(meta[16:], uint64(len(want)))
	copy(meta[24:], etag)
	for i := mirrorHeader; i < len(meta); i++ {
		meta[i] = 0xFF // every page "mirrored"
	}
	base := filepath.Join(dir, url.PathEscape(mirrorKey))
	if err := os.WriteFile(base+".meta", meta, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(base+".data", make([]byte, len(want)), 0o600); err != nil { // zeros
		t.Fatal(err)
	}
	src, st, sf, logs := openMirrored(t, f, dir, 64<<20)
	check(t, sf, want, []int64{0, 5 << 20}, 4096)
	if st.MirrorHits.Load() != 0 {
		t.Errorf("%d hits from a mirror of the old format", st.MirrorHits.Load())
	}
	if logs.FilterMessageSnippet("discard").FilterFieldKey("reason").Len() == 0 {
		t.Errorf("no log line saying the old mirror was discarded: %v", logs.All())
	}
	closeAll(t, sf, src)
}

// recordingSys records the writer's system calls on mirror files, in
// order, as "write data|meta OFF LEN" and "sync data|meta".
type recordingSys struct {
	osSys
	mu  sync.Mutex
	ops []string
}

func role(f *os.File) string {
	if strings.HasSuffix(f.Name(), ".meta") {
		return "meta"
	}
	return "data"
}

func (r *recordingSys) pwrite(f *os.File, b []byte, off int64) error {
	r.mu.Lock()
	r.ops = append(r.ops, fmt.Sprintf("write %s %d %d", role(f), off, len(b)))
	r.mu.Unlock()
	return r.osSys.pwrite(f, b, off)
}

func (r *recordingSys) fdatasync(f *os.File) error {
	r.mu.Lock()
	r.ops = append(r.ops, "sync "+role(f))
	r.mu.Unlock()
	return r.osSys.fdatasync(f)
}

// A page's bit (and checksum) reach NAME.meta only after its data is
// durable: between a write of the data file and the next write of the
// bitmap or the checksums there is always an fdatasync of the data file.
// A crash at any point then leaves no bit over bytes that may not be on
// disk (the mirror would serve zeros for them).
func TestMirrorBitsFollowDurableData(t *testing.T) {
	f, want := fakeMirrorObject(t, 26)
	src, _, _ := loggedMirrorSource(t, f, t.TempDir(), 4<<20)
	rec := &recordingSys{}
	src.mir.sys = rec
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	for off := int64(0); off+(1<<20) <= int64(len(want)); off += 3 << 20 { // evicting, too
		check(t, sf, want, []int64{off, off + 8192}, 5000)
		src.mir.sync()
	}
	closeAll(t, sf, src)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	unsynced, bitWrites := false, 0
	for i, op := range rec.ops {
		var kind, file string
		var off int64
		fmt.Sscanf(op, "%s %s %d", &kind, &file, &off)
		switch {
		case kind == "write" && file == "data":
			unsynced = true
		case kind == "sync" && file == "data":
			unsynced = false
		case kind == "write" && file == "meta" && off >= mirrorHeader:
			bitWrites++
			if unsynced {
				t.Fatalf("op %d, %q: the bitmap or checksums written while data written before is not yet durable; ops: %v", i, op, rec.ops[:i+1])
			}
		}
	}
	if bitWrites == 0 {
		t.Fatalf("no bitmap write recorded: %v", rec.ops)
	}
}

// The mirror on a filesystem smaller than its budget: the budget is
// lowered at open, with a warning, to what the filesystem can hold; and
// when another file then takes the room, the mirror's writes fail with
// ENOSPC: counted, logged, the budget lowered again and extents evicted,
// so pages read later are mirrored still (the mirror used to stop
// mirroring for good, silently).
func TestMirrorOutOfSpace(t *testing.T) {
	testenv.RequireFUSE(t) // root, to mount a small tmpfs
	dir := t.TempDir()
	const fsSize = 12 << 20
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d", fsSize)); err != nil {
		t.Fatalf("mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	mdir := filepath.Join(dir, "mirror")
	f, want := fakeMirrorObject(t, 27)
	src, st, logs := loggedMirrorSource(t, f, mdir, 64<<20)
	if b := int64(st.MirrorBudgetBytes.Load()); b <= 0 || b > fsSize {
		t.Errorf("mirror_budget_bytes %d on a %d-byte filesystem, with --s3-mirror-size 64MiB", b, fsSize)
	}
	if logs.FilterMessageSnippet("filesystem").FilterLevelExact(zapcore.WarnLevel).Len() == 0 {
		t.Errorf("no warning that the budget exceeds the filesystem: %v", logs.All())
	}
	sf, err := src.Open(mirrorKey)
	if err != nil {
		t.Fatal(err)
	}
	check(t, sf, want, []int64{0, 1 << 20}, 1<<20)
	src.mir.sync()
	// Another user takes the room left but for 4 MiB.
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	hog := make([]byte, int64(sfs.Bavail)*sfs.Bsize-(4<<20))
	if err := os.WriteFile(filepath.Join(dir, "hog"), hog, 0o600); err != nil {
		t.Fatal(err)
	}
	for off := int64(2 << 20); off+(1<<20) <= int64(len(want)); off += 1 << 20 {
		check(t, sf, want, []int64{off}, 1<<20)
		src.mir.sync()
	}
	if st.MirrorWriteErrors.Load() == 0 {
		t.Fatal("no mirror write failed on a full filesystem: the test proves nothing")
	}
	if logs.FilterMessageSnippet("no space").Len() == 0 {
		t.Errorf("no log line about the failed writes: %v", logs.All())
	}
	if st.MirrorEvictions.Load() == 0 {
		t.Error("no eviction to make room")
	}
	t.Logf("%d write errors, %d evictions, budget now %d bytes, %d bytes mirrored", st.MirrorWriteErrors.Load(), st.MirrorEvictions.Load(), st.MirrorBudgetBytes.Load(), st.MirrorBytesWritten.Load())
	// The last megabyte read is mirrored: served again with no GET.
	last := int64(len(want))/(1<<20)*(1<<20) - 1<<20
	gets := st.S3Gets.Load()
	check(t, sf, want, []int64{last}, 1<<20)
	if st.S3Gets.Load() != gets {
		t.Errorf("the last megabyte read after the filesystem filled up was not mirrored (%d GETs): the mirror stopped mirroring", st.S3Gets.Load()-gets)
	}
	closeAll(t, sf, src)
}
