package backing

import (
	"fmt"
	"sync"

	"github.com/engramfs/engramfs/internal/stats"
)

// TableRead is one read of a table's data: Len bytes at Off (relative to
// row 0).
type TableRead struct {
	Table  *Table
	Off    int64
	Len    int
	Demand bool // a reader is blocked on it; see ShardRead.Demand
	// Done receives exactly Len bytes or an error, once, from any goroutine;
	// it must not block.
	Done func(data []byte, err error)
}

// Reader reads table data in batches. It is the seam where tests inject
// backing faults (NewFaultReader).
type Reader interface {
	Submit(reads ...*TableRead)
}

// SyncReader is a Reader that can also run reads on the calling goroutine:
// ReadSync returns once every read's Done has been called. The fault path
// uses it, since its caller waits anyway: one blocking read on the thread
// that serves the FUSE request costs fewer context switches than handing
// the read to an engine and waiting for its completion thread.
type SyncReader interface {
	Reader
	ReadSync(reads ...*TableRead)
}

// Store reads tables from their shards, opened through a Source.
type Store struct {
	st    *stats.Counters
	files map[*Shard]ShardFile // written by Open only
}

var _ SyncReader = (*Store)(nil)

// syncShard is a ShardFile whose reads can run on the calling goroutine.
type syncShard interface {
	ReadSync(reads ...*ShardRead)
}

// Open opens every shard of m through src. A shard that is not what it was
// when m was loaded fails with ErrShardChanged.
func Open(m *Model, src Source, st *stats.Counters) (*Store, error) {
	s := &Store{st: st, files: map[*Shard]ShardFile{}}
	for _, sh := range m.Shards {
		sf, err := src.Open(sh.Name)
		if err != nil {
			s.Close()
			return nil, err
		}
		s.files[sh] = sf
		if id := sf.Identity(); !id.Equal(sh.Identity) {
			s.Close()
			return nil, fmt.Errorf("shard %s: %w (now %v; at load %v)", sh.Path, ErrShardChanged, id, sh.Identity)
		}
	}
	return s, nil
}

// Direct reports whether shard sh is read with O_DIRECT.
func (s *Store) Direct(sh *Shard) bool {
	d, ok := s.files[sh].(interface{ Direct() bool })
	return ok && d.Direct()
}

// Submit starts reads; see Reader.
func (s *Store) Submit(reads ...*TableRead) { s.submit(false, reads) }

// ReadSync runs reads on the calling goroutine where the shard can (local
// files), else submits them; it returns once every Done has been called.
func (s *Store) ReadSync(reads ...*TableRead) {
	var wg sync.WaitGroup
	wg.Add(len(reads))
	for _, r := range reads {
		done := r.Done
		r.Done = func(data []byte, err error) { done(data, err); wg.Done() }
	}
	s.submit(true, reads)
	wg.Wait()
}

func (s *Store) submit(inline bool, reads []*TableRead) {
	byShard := map[ShardFile][]*ShardRead{}
	var order []ShardFile
	for _, r := range reads {
		t := r.Table
		if r.Off < 0 || r.Len < 0 || r.Off > t.DataLen || int64(r.Len) > t.DataLen-r.Off { // no off+n: it can overflow
			r.Done(nil, fmt.Errorf("table %s: read [%d, +%d) outside its %d data bytes", t.Name, r.Off, r.Len, t.DataLen))
			continue
		}
		sf := s.files[t.Shard]
		if sf == nil {
			r.Done(nil, fmt.Errorf("table %s: shard %s: %w", t.Name, t.Shard.Path, ErrClosed))
			continue
		}
		if _, ok := byShard[sf]; !ok {
			order = append(order, sf)
		}
		byShard[sf] = append(byShard[sf], s.shardRead(r))
	}
	for _, sf := range order {
		if ss, ok := sf.(syncShard); ok && inline {
			ss.ReadSync(byShard[sf]...)
		} else {
			sf.Submit(byShard[sf]...)
		}
	}
}

func (s *Store) shardRead(r *TableRead) *ShardRead {
	t := r.Table
	abs := t.DataStart + r.Off
	return &ShardRead{Off: abs, Len: r.Len, Demand: r.Demand, Done: func(data []byte, err error) {
		if err != nil {
			s.st.BackingErrors.Add(1)
			err = fmt.Errorf("table %s: %w", t.Name, err)
		}
		r.Done(data, err)
	}}
}

// ReadTable reads n bytes of t's data at off through r and waits for them:
// for tests and setup. It returns what r answered, short or not.
func ReadTable(r Reader, t *Table, off int64, n int) ([]byte, error) {
	type result struct {
		data []byte
		err  error
	}
	ch := make(chan result, 1)
	r.Submit(&TableRead{Table: t, Off: off, Len: n, Done: func(data []byte, err error) { ch <- result{data, err} }})
	res := <-ch
	return res.data, res.err
}

// Close closes every shard.
func (s *Store) Close() error {
	var first error
	for sh, sf := range s.files {
		if err := sf.Close(); err != nil && first == nil {
			first = fmt.Errorf("shard %s: %w", sh.Path, err)
		}
	}
	return first
}

// ReaderFunc is a Reader made of a blocking read function, each read run on
// a goroutine of its own: for tests and fakes, not for the data path.
type ReaderFunc func(t *Table, off int64, n int) ([]byte, error)

// Submit runs every read on its own goroutine.
func (f ReaderFunc) Submit(reads ...*TableRead) {
	for _, r := range reads {
		go func() { r.Done(f(r.Table, r.Off, r.Len)) }()
	}
}
