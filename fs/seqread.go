package fs

import (
	"context"
	"os"
	"strconv"
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"
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
	// back to back before readahead starts. A random reader's fault is one
	// page, a row two at most: it never gets there.
	seqTrigger = 64 << 10
	// seqWindow is how far ahead of the reader's last miss the pushes
	// reach; a new window is asked for once the reader's misses pass half
	// of the one pushed.
	seqWindow = 8 << 20
)

// seqRun follows one handle's reads that reach the daemon (page cache
// misses) and says when, and what, to read ahead.
type seqRun struct {
	mu     sync.Mutex
	next   int64 // GUARDED_BY(mu); end of the last read
	streak int64 // GUARDED_BY(mu); bytes read back to back so far
	ahead  int64 // GUARDED_BY(mu); end of the readahead asked for
}

// observe records a read of [off, end) in a file of size bytes and returns
// the range to read ahead now, if any (from < to). A read that lands beyond
// the last one but inside what was read ahead continues the run: the pages
// between were pushed, so the kernel asked for none of them.
func (s *seqRun) observe(off, end, size int64) (from, to int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if off == s.next || (off > s.next && off <= s.ahead) {
		s.streak += end - off
	} else {
		s.streak, s.ahead = end-off, 0
	}
	s.next = end
	if s.streak < seqTrigger || s.ahead >= min(end+seqWindow/2, size) {
		return 0, 0
	}
	from, to = max(s.ahead, end), min(end+seqWindow, size)
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
