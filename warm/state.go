// Package warm makes a restarted daemon warm within seconds: on a clean
// stop the hot tier's page keys (not their data) are saved to a state file;
// on mount they are fetched again in the background, as prefill work, and
// admitted to the hot tier as decode work, so they end up pinned again.
package warm

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
)

// The state file:
//
//	magic                      "engramfs-warm-state 1\n"
//	header length              u32, little-endian
//	header                     JSON: Header (the model identity, the page count)
//	pages                      per page: uvarint table index, uvarint page number
//	checksum                   u32 little-endian, CRC-32 (IEEE) of everything before it
//
// Page keys only, never data: ~4 bytes a page (1 MiB for a 1 GiB tier).
const magic = "engramfs-warm-state 1\n"

// maxHeaderBytes bounds the header we read (a model of thousands of tables
// stays far below it).
const maxHeaderBytes = 16 << 20

// Header says which model the pages belong to. Pages of another model (or
// of this one after its tables changed) would be wrong offsets: the state
// is used only when every table matches.
type Header struct {
	PageSize int       `json:"page_size"`
	Tables   []TableID `json:"tables"`
	Pages    int       `json:"pages"`
	Saved    time.Time `json:"saved"`
}

// TableID is what identifies a table file's layout.
type TableID struct {
	Name     string `json:"name"`
	Dtype    string `json:"dtype"`
	Rows     uint64 `json:"rows"`
	RowBytes int64  `json:"row_bytes"`
	FileSize int64  `json:"file_size"`
}

// Identity is the model's table list as the header records it.
func Identity(m *backing.Model) []TableID {
	ids := make([]TableID, len(m.Tables))
	for i, t := range m.Tables {
		ids[i] = TableID{Name: t.Name, Dtype: t.Dtype, Rows: t.Rows, RowBytes: t.RowBytes, FileSize: t.FileSize}
	}
	return ids
}

// ErrOtherModel means the state file was saved for another model (or the
// model's tables changed since): it is ignored.
var ErrOtherModel = errors.New("state file is for another model")

// Save writes keys of model m to path atomically: a temporary file in the
// same directory, synced, then renamed over path, so a crash leaves the old
// state or the new one, never half of one.
func Save(path string, m *backing.Model, keys []cache.PageKey) error {
	hdr, err := json.Marshal(Header{PageSize: cache.PageSize, Tables: Identity(m), Pages: len(keys), Saved: time.Now().UTC()})
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	buf.Grow(len(magic) + 4 + len(hdr) + 5*len(keys) + 4)
	buf.WriteString(magic)
	buf.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(hdr))))
	buf.Write(hdr)
	var v []byte
	for _, k := range keys {
		v = binary.AppendUvarint(v[:0], uint64(k.Table))
		v = binary.AppendUvarint(v, k.Page)
		buf.Write(v)
	}
	buf.Write(binary.LittleEndian.AppendUint32(nil, crc32.ChecksumIEEE(buf.Bytes())))

	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("warm state %s: %w", path, err)
	}
	tmp := f.Name()
	if _, err := f.Write(buf.Bytes()); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("warm state %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("warm state %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("warm state %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("warm state %s: %w", path, err)
	}
	// The rename is durable once the directory is.
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// Load reads the state file at path for model m, and returns at most
// maxPages of its pages (the first ones: hottest first within each shard of
// the tier), skipping pages outside the tables and pages named again (a
// file with 300,000 copies of one key warmed it 16,384 times over and
// reported 16,384 pages pinned, where one was). A missing file is
// os.ErrNotExist; a file for another model, ErrOtherModel (wrapped with the
// difference); a damaged one, an error that says so.
func Load(path string, m *backing.Model, maxPages int) ([]cache.PageKey, Header, error) {
	var hdr Header
	bad := func(what string, err error) error {
		if err != nil {
			return fmt.Errorf("warm state %s: %s: %w", path, what, err)
		}
		return fmt.Errorf("warm state %s: %s", path, what)
	}
	f, err := backing.OpenRegular(path, 0) // never blocks on a FIFO
	if err != nil {
		return nil, hdr, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, hdr, err
	}
	// A page takes at most 15 bytes (two uvarints), so a file larger than
	// this holds pages we would not use anyway: refuse it rather than read
	// an unbounded file into memory.
	limit := int64(len(magic)) + 4 + maxHeaderBytes + 15*int64(max(maxPages, 0)) + 4
	if fi.Size() > limit {
		return nil, hdr, bad(fmt.Sprintf("%d bytes, more than a state for %d pages can take", fi.Size(), maxPages), nil)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, hdr, err
	}
	if len(b) < len(magic)+8 || string(b[:len(magic)]) != magic {
		return nil, hdr, bad("not an engramfs warm state file", nil)
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if crc32.ChecksumIEEE(body) != sum {
		return nil, hdr, bad("checksum mismatch (truncated or damaged)", nil)
	}
	rest := body[len(magic):]
	n := binary.LittleEndian.Uint32(rest)
	rest = rest[4:]
	if uint64(n) > uint64(len(rest)) {
		return nil, hdr, bad("truncated header", nil)
	}
	if err := json.Unmarshal(rest[:n], &hdr); err != nil {
		return nil, hdr, bad("header", err)
	}
	rest = rest[n:]
	if err := sameModel(hdr, m); err != nil {
		return nil, hdr, fmt.Errorf("warm state %s: %w", path, err)
	}
	if hdr.Pages < 0 {
		return nil, hdr, bad("negative page count", nil)
	}
	keys := make([]cache.PageKey, 0, max(0, min(hdr.Pages, maxPages)))
	seen := make(map[cache.PageKey]struct{}, cap(keys))
	for i := 0; i < hdr.Pages; i++ {
		table, k := binary.Uvarint(rest)
		if k <= 0 {
			return nil, hdr, bad("truncated page list", nil)
		}
		rest = rest[k:]
		page, k := binary.Uvarint(rest)
		if k <= 0 {
			return nil, hdr, bad("truncated page list", nil)
		}
		rest = rest[k:]
		if table >= uint64(len(m.Tables)) || len(keys) >= maxPages {
			continue
		}
		if t := m.Tables[table]; page < t.DataPage() || page >= t.Pages() {
			continue
		}
		key := cache.PageKey{Table: uint32(table), Page: page}
		if _, dup := seen[key]; dup {
			continue
		}
		seen[key] = struct{}{}
		keys = append(keys, key)
	}
	if len(rest) != 0 {
		return nil, hdr, bad(fmt.Sprintf("%d bytes after the page list", len(rest)), nil)
	}
	return keys, hdr, nil
}

func sameModel(h Header, m *backing.Model) error {
	if h.PageSize != cache.PageSize {
		return fmt.Errorf("%w: page size %d, want %d", ErrOtherModel, h.PageSize, cache.PageSize)
	}
	want := Identity(m)
	if len(h.Tables) != len(want) {
		return fmt.Errorf("%w: %d tables, this model has %d", ErrOtherModel, len(h.Tables), len(want))
	}
	for i := range want {
		if h.Tables[i] != want[i] {
			return fmt.Errorf("%w: table %d is %+v, this model's is %+v", ErrOtherModel, i, h.Tables[i], want[i])
		}
	}
	return nil
}
