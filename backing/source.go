package backing

import (
	"errors"
	"fmt"
	"io"
	"time"
)

// Source is where a model's files live: a local or NFS directory, or an
// object store prefix. It is the seam between engramfs and storage: model
// loading lists and reads small files through it, and the Store reads table
// data through the ShardFiles it opens. Every implementation must pass
// sourcetest.Run (backing/sourcetest).
type Source interface {
	// String names the source in logs, errors and manifest.json: a
	// directory, or s3://bucket/prefix. It never holds credentials.
	String() string
	// List returns the names of the files directly in the source whose
	// names end in suffix, sorted.
	List(suffix string) ([]string, error)
	// ReadFile returns the whole of a small file (the index). A missing file
	// is an error matching fs.ErrNotExist; a file over limit bytes is an
	// error.
	ReadFile(name string, limit int64) ([]byte, error)
	// Open opens shard name for reads.
	Open(name string) (ShardFile, error)
}

// ShardFile is one open shard.
type ShardFile interface {
	// ReadAt reads synchronously: headers and setup, never the data path.
	io.ReaderAt
	// Identity is what the shard was when opened.
	Identity() Identity
	// Submit queues data-path reads (offsets in the shard). It never waits
	// for I/O. Each read's Done is called exactly once, from any goroutine,
	// possibly before Submit returns.
	Submit(reads ...*ShardRead)
	// Close releases the shard; reads still queued fail with ErrClosed.
	Close() error
}

// ShardRead is one data-path read of a shard: Len bytes at Off.
type ShardRead struct {
	Off int64
	Len int
	// Demand: a reader is blocked on it (a fault). Sources with lanes (an
	// object store) serve and hedge these first.
	Demand bool
	// Done receives exactly Len bytes, or an error: never a short result
	// without one. data belongs to the receiver from then on. Done must not
	// block: it runs on the engine's completion goroutine.
	Done func(data []byte, err error)
}

// Identity says which bytes a shard holds. Two identities that differ mean
// the offsets read from the old header can no longer be trusted.
type Identity struct {
	Size int64
	// Local files: a rewrite in place with the old mtime restored (cp
	// --preserve=timestamps, rsync -t --inplace) still changes ctime.
	MTime, CTime time.Time
	Dev, Inode   uint64
	// Object stores: the object's ETag.
	ETag string
}

// Equal reports whether a and b name the same bytes.
func (a Identity) Equal(b Identity) bool {
	return a.Size == b.Size && a.MTime.Equal(b.MTime) && a.CTime.Equal(b.CTime) &&
		a.Dev == b.Dev && a.Inode == b.Inode && a.ETag == b.ETag
}

func (a Identity) String() string {
	if a.ETag != "" {
		return fmt.Sprintf("size %d, etag %s", a.Size, a.ETag)
	}
	return fmt.Sprintf("size %d, mtime %v, ctime %v, inode %d", a.Size, a.MTime, a.CTime, a.Inode)
}

// ErrShardChanged means a shard's identity differs from when the model was
// loaded: its bytes can no longer be trusted at the offsets we know.
var ErrShardChanged = errors.New("shard changed since mount")

// ErrClosed fails reads submitted to, or still queued in, a closed shard.
var ErrClosed = errors.New("shard closed")

// PageError reports whether err may be specific to the bytes read (a bad
// sector, a flaky request), so that reading a failed run again page by page
// can save the good pages. A changed or closed shard fails every page alike.
func PageError(err error) bool {
	return err != nil && !errors.Is(err, ErrShardChanged) && !errors.Is(err, ErrClosed)
}
