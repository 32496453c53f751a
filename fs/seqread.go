package fs

import (
	"context"
	"errors"
	"os"
	"strconv"
	"sync"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/cache"
)

// Sequential readahead, done by the daemon. MaxReadAhead is a setting of
// the whole connection (the kernel sets the mount's bdi ra_pages from the
// INIT reply), not of a file: at one page, which the table files need (a
// random fault must cost one page of backing I/O), `dd bs=1M` of a table
// became 16,384 FUSE reads of 4 KiB for 64 MiB, 65× slower than reading the
// shard. So a handle that reads sequentially gets its next pages read and
// pushed into the page cache (NOTIFY_STORE) ahead of it; the kernel then
// finds them cached and the reader's next miss is a window further on.
const (
	// seqTrigger: a handle's reads must have covered this many bytes
	// back to back before readahead starts (a table raises it above two
	// of its rows: a random gather reads a row, a row and a page at most,
	// back to back). A random reader never gets there. Each byte before
	// it is a FUSE read of a page, ~60 µs: 64 KiB made a 64 MiB table's
	// straight read wait ~1 ms before its first push.
	seqTrigger = 32 << 10
	// seqFirstWindow is the first window, once triggered: the bytes of
	// a scan's first pieces. A window that started at one piece and grew
	// by four times the run (1, 4, 21 MiB) made the reader miss at the end
	// of each and wait for the next one's first piece; 8 MiB, the disk's
	// own readahead here (`read_ahead_kb` 8192), took a 64 MiB table's
	// `dd` from 0.70-0.79× the shard to 0.78-0.85× (seven interleaved
	// pairs with the trigger above, BenchmarkModelDirSequentialRead,
	// 2026-12-06). A scan that stops right after the trigger reads 8 MiB
	// too many, once.
	seqFirstWindow = 8 << 20
	// seqWindow is the most the pushes reach ahead of the reader's last
	// miss. The window starts at seqFirstWindow and grows with the run
	// (four times the bytes read back to back). Every miss tops it up, a
	// piece or more: the reader's page cache hits never reach the daemon,
	// so a miss is the only news of where it is. Asking again only once
	// the misses passed half the window left the pushes idle whenever the
	// reader missed early in a window and then not again until its end,
	// where it waited for the next window's first piece: no read in
	// flight 14-18% of a table's `dd`, against 6-7% topping up.
	seqWindow = 32 << 20
	// pushChunk is one backing read and one page cache store of the
	// readahead; pushParallel of them are in flight per handle, of which
	// loadParallel read at once: the store is the daemon's CPU (a copy
	// into fresh page cache folios, ~0.9 ms a MiB), the read the disk's,
	// and a virtio disk streams best at two reads in flight (fio, 1 MiB
	// O_DIRECT reads: 3.0 GB/s at QD2, 1.9-2.0 at QD4-8). Four pieces each
	// reading then storing kept the disk at QD4 and the stores waiting
	// behind it: table/shard 0.23-0.36 against 0.32-0.38 with 8 pieces
	// and 2 reads (BenchmarkModelDirSequentialRead, four runs each,
	// interleaved, 2026-12-05).
	pushChunk    = 1 << 20
	pushParallel = 8
	loadParallel = 2
	// maxPushes bounds the pieces in flight across all handles: each holds
	// a pushChunk buffer, and a thousand readers must not hold 4 GiB.
	maxPushes = 16
)

// pushSlots is taken by every piece in flight, all handles together.
var pushSlots = make(chan struct{}, maxPushes)

// seqRun follows one handle's reads that reach the daemon (page cache
// misses) and says when, and what, to read ahead.
type seqRun struct {
	mu     sync.Mutex
	next   int64 // GUARDED_BY(mu); end of the last read
	streak int64 // GUARDED_BY(mu); bytes read back to back so far
	ahead  int64 // GUARDED_BY(mu); end of the readahead asked for
}

// observe records a read of [off, end) in a file of size bytes and returns
// the range to read ahead now, if any (from < to), once trigger bytes were
// read back to back. A read that lands beyond the last one but inside what
// was read ahead continues the run: the pages between were pushed, so the
// kernel asked for none of them.
func (s *seqRun) observe(off, end, size, trigger int64) (from, to int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if off == s.next || (off > s.next && off <= s.ahead) {
		s.streak += end - s.next
	} else {
		s.streak, s.ahead = end-off, 0
	}
	s.next = end
	window := min(seqWindow, max(seqFirstWindow, 4*s.streak))
	if s.streak < max(trigger, seqTrigger) || s.ahead >= min(end+window-pushChunk, size) {
		return 0, 0
	}
	from, to = max(s.ahead, end), min(end+window, size)
	if from >= to {
		return 0, 0
	}
	s.ahead = to
	return from, to
}

// ownOpen reports whether the process that opens a file is the daemon
// itself (its live table opens, the hot tier's pinner): its reads follow
// hints and pins, never a scan to read ahead of. FUSE names the opener by
// thread id; the daemon's threads are the entries of /proc/self/task.
func ownOpen(ctx context.Context) bool {
	caller, ok := fuse.FromContext(ctx)
	if !ok {
		return false
	}
	_, err := os.Stat("/proc/self/task/" + strconv.FormatUint(uint64(caller.Pid), 10))
	return err == nil
}

// readAhead pushes the windows seqRun asks for into one file's page cache,
// for one handle. Its loaders (loadLoop) take the pieces in order.
type readAhead struct {
	seq     seqRun
	size    int64
	trigger int64 // bytes read back to back before readahead; at least seqTrigger
	// fill reads len(b) bytes at off (page-aligned), fewer only at the
	// end of the file.
	fill func(b []byte, off int64) (int, error)
	// read, if set, reads [off, off+n) (fewer only at the end of the
	// file) into buf, a pushBuf, and returns the slice of buf that holds
	// them: the table's data straight from the shard, stored from where
	// it landed. An error matching errors.ErrUnsupported: fill instead.
	read func(buf []byte, off, n int64) ([]byte, error)
	// store puts data into the file's page cache at off: the inode's
	// WriteCache (NOTIFY_STORE).
	store func(off int64, data []byte) syscall.Errno

	// sem is taken by each of the handle's pieces in flight
	// (pushParallel), pushSlots by each of everyone's; made by the first
	// observe that pushes.
	sem     chan struct{}
	mu      sync.Mutex
	next    int64          // GUARDED_BY(mu); the first byte not handed out yet
	target  int64          // GUARDED_BY(mu); push up to here
	loaders int            // GUARDED_BY(mu); loadLoops running
	closed  bool           // GUARDED_BY(mu)
	wg      sync.WaitGroup // loaders and stores
}

// pushBufs holds the pieces' buffers: pushChunk and the slack of an
// O_DIRECT read's aligned superset, page-aligned. Reused, never zeroed
// again: a fresh 1 MiB buffer per piece cost the daemon more CPU (clearing
// it, faulting it in, the scavenger handing it back) than the read.
// At most maxPushes are in use at once.
var pushBufs = sync.Pool{New: func() any {
	b := backing.AlignedBuf(pushChunk+2*backing.IntoAlign, backing.IntoAlign)
	return &b
}}

// observe records a read of [off, end) that reached the daemon and starts
// pushing when the handle reads sequentially. It never waits for I/O.
func (r *readAhead) observe(off, end int64) {
	from, to := r.seq.observe(off, end, r.size, r.trigger)
	if from >= to {
		return
	}
	from &^= cache.PageSize - 1
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	if from < r.next || from > r.target {
		r.next = from // a new run: the old one's rest is not wanted
	}
	r.target = to
	if r.sem == nil {
		r.sem = make(chan struct{}, pushParallel)
	}
	for r.loaders < loadParallel {
		r.loaders++
		r.wg.Add(1)
		go r.loadLoop()
	}
}

// loadLoop is one of a handle's loadParallel loaders: it takes the next
// piece, reads it, hands it to a goroutine of its own to store and takes
// the next, until the target is reached. Never from a Read handler: a
// store waits on the folio a read holds locked.
//
// The loader that read a piece starts the next read itself, at once: a
// run goroutine that handed each piece to a new goroutine left the disk
// at one read 22% of a table's `dd`, the next read waiting for a
// scheduler hand-off (up to 2 ms on these 2-vCPU guests, whose CPUs the
// stores and the reader keep busy). And taking the pieces in order, the
// reads start in the order of their offsets: the reader at a window's
// start waits on its first pieces, not on a piece read out of order.
func (r *readAhead) loadLoop() {
	defer r.wg.Done()
	for {
		// The slots first, then the piece: a piece taken before waiting
		// for a slot would be pushed after a failure had stopped the run.
		r.sem <- struct{}{}
		pushSlots <- struct{}{}
		r.mu.Lock()
		if r.closed || r.next >= r.target {
			r.loaders--
			r.mu.Unlock()
			r.release()
			return
		}
		off := r.next
		n := min(pushChunk, r.target-off)
		r.next += n
		r.mu.Unlock()
		bp := pushBufs.Get().(*[]byte)
		data, err := r.load(*bp, off, n)
		if len(data) == 0 || err != nil {
			// A read error, which the reader's own read will report.
			pushBufs.Put(bp)
			r.release()
			r.stop()
			continue
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer r.release()
			defer pushBufs.Put(bp)
			if r.store(off, data) != 0 {
				r.stop() // the mount is going
			}
		}()
	}
}

// release gives back the slots a loader took for a piece.
func (r *readAhead) release() {
	<-pushSlots
	<-r.sem
}

// load reads [off, off+n) into buf: through read where it can, else fill.
func (r *readAhead) load(buf []byte, off, n int64) ([]byte, error) {
	if r.read != nil {
		data, err := r.read(buf, off, n)
		if !errors.Is(err, errors.ErrUnsupported) {
			return data, err
		}
	}
	got, err := r.fill(buf[:n], off)
	return buf[:got], err
}

// stop drops what is left to push.
func (r *readAhead) stop() {
	r.mu.Lock()
	r.next = r.target
	r.mu.Unlock()
}

// close stops pushing and waits for the pushes in flight (Release).
func (r *readAhead) close() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.wg.Wait()
}
