package main

import (
	"fmt"
	"path/filepath"

	units "github.com/docker/go-units"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/backing/s3source"
	"github.com/engramfs/engramfs/internal/memcg"
	"github.com/engramfs/engramfs/internal/nofile"
	"github.com/engramfs/engramfs/internal/stats"
)

// Descriptors a mount holds, by what holds them (counted in the code named):
const (
	// The standard streams, the Go runtime's epoll and eventfd, /dev/fuse,
	// the mount's readiness check, the read engine's ring and eventfd, the
	// pinner's pagemap, userfaultfd and the open of a table it maps, the
	// metrics listener and a few scrapes, the state file, and slack for
	// the log, a warm-up and what libraries open.
	descriptorsBase = 3 + 2 + 2 + 2 + 3 + 5 + 1 + 32
	// Per table: the server's own open, held for the mount's life
	// (fs.Server.Serve), and the pinner's read-through descriptor
	// (cache.Pinner.readThrough), once the table has a pinned page.
	descriptorsPerTable       = 1
	descriptorsPerPinnedTable = 1
	// Per shard: a local shard's open (O_DIRECT or buffered); an object's
	// mirror files (NAME.data twice, NAME.meta).
	descriptorsPerLocalShard    = 1
	descriptorsPerMirroredShard = 3
)

// checkDescriptors makes sure RLIMIT_NOFILE covers what a mount of tables
// tables in shards shards holds (raising the soft limit toward the hard one
// if needed), or says what to raise it to. It runs once the model's tables
// are counted and before anything is built for them: a 100K-table model
// failed on the limit only when the server opened its table files, after
// 76 s of CPU and 765 MB (now: refused after 0.7 s and 73 MB).
func checkDescriptors(modelDir string, mf mountFlags, tables, shards int) error {
	n := descriptorsBase + descriptorsPerTable*tables
	if capacity, err := units.RAMInBytes(mf.cacheSize); err != nil || capacity > 0 {
		n += descriptorsPerPinnedTable * tables
	}
	if s3source.IsURL(modelDir) {
		// A connection per GET in flight, as many kept idle.
		n += 2 * mf.queueDepth
		if mf.s3Mirror != "" {
			n += 1 + descriptorsPerMirroredShard*shards // and the directory's lock
		}
	} else {
		n += descriptorsPerLocalShard * shards
	}
	return nofile.Need(uint64(n), fmt.Sprintf("to serve %s in %s", count(tables, "table"), count(shards, "shard")))
}

// count is "1 table", "2 tables".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// The memory the daemon needs in its memory cgroup besides the hot tier.
// Its own: heap (the loader's buffers, the prefetcher's queues, go-fuse's
// request buffers), page tables and kernel memory; measured in a 256 MiB
// group under hinted decode (TestMemcgDaemonTierFitsItsCgroup, 160 steps
// of 1,024 new rows): 20 MiB anonymous (72 MiB in a -race build), 36 MiB
// at the kill below, 1.9 MiB of page tables for a 768 MiB table. And page
// cache it charges itself and can reclaim, which grows with what it
// serves: pages it pushes for hints until they are read, its read-through
// of pages to pin. A tier that left the group only a sliver of reclaimable
// page cache stalled every thread of the daemon in the group's reclaim,
// under the pinner's populate, with no OOM kill and nothing logged: a 192
// MiB tier in a 256 MiB group (v2) ran ~500x slower once full; on v1 here
// the kernel killed the daemon with 230 MiB locked and left the mount
// dead. So: memcgHeadroomBase for the daemon itself and 1/memcgHeadroomPart
// of the limit for page cache (256 MiB: a 160 MiB tier; 4 GiB: 3.4 GiB).
const (
	memcgHeadroomBase = 64 << 20
	memcgHeadroomPart = 8
	// minTier is the smallest tier worth pinning: below it the daemon
	// refuses to start rather than run a tier that holds nothing.
	minTier = 16 << 20
)

// memcgHeadroom is what the daemon keeps out of its tier in a memory
// cgroup of limit bytes.
func memcgHeadroom(limit int64) int64 { return memcgHeadroomBase + limit/memcgHeadroomPart }

// fitTierToMemcg fits a tier of capacity bytes to the daemon's own memory
// cgroup (internal/memcg: the tightest limit on its group and its
// ancestors): it returns capacity, or less (logged), or an error when not
// even minTier fits. The stats say the limit and what was asked;
// cache_capacity_bytes, set by the tier, says what is in force.
func fitTierToMemcg(capacity int64, st *stats.Counters, log *zap.Logger) (int64, error) {
	st.CacheRequestedBytes.Store(capacity)
	self, err := memcg.Own()
	if err != nil {
		return capacity, nil // no memory cgroup: no limit but the node's
	}
	l, err := self.Limit()
	if err != nil {
		log.Warn("the daemon's memory cgroup limit is unreadable: the hot tier is not fitted to it", zap.Stringer("cgroup", self), zap.Error(err))
		return capacity, nil
	}
	st.MemcgLimitBytes.Store(l.Bytes)
	fitted, err := fitTier(capacity, l)
	if err == nil && fitted < capacity {
		log.Warn("hot tier clamped to fit the memory cgroup",
			zap.Int64("cache_size_asked", capacity), zap.Int64("cache_size", fitted),
			zap.Int64("memcg_limit", l.Bytes), zap.String("limit_file", filepath.Join(l.Dir, l.File)),
			zap.Int64("headroom", memcgHeadroom(l.Bytes)))
	}
	return fitted, err
}

// fitTier is the tier of at most capacity bytes that fits limit l with
// headroom, or why none does.
func fitTier(capacity int64, l memcg.Limit) (int64, error) {
	if l.Bytes == 0 || capacity == 0 {
		return capacity, nil
	}
	room := l.Bytes - memcgHeadroom(l.Bytes)
	if capacity <= room {
		return capacity, nil
	}
	if room < minTier {
		need := (minTier + memcgHeadroomBase) * memcgHeadroomPart / (memcgHeadroomPart - 1)
		return 0, usagef("--cache-size %s: the daemon's memory cgroup allows %s (%s), which leaves no room for a hot tier: "+
			"the daemon needs %s of it besides the tier, and a tier at least %s; raise the limit (MemoryMax=) to %s or more, or pass --cache-size 0",
			units.BytesSize(float64(capacity)), units.BytesSize(float64(l.Bytes)), filepath.Join(l.Dir, l.File),
			units.BytesSize(float64(memcgHeadroom(l.Bytes))), units.BytesSize(minTier), units.BytesSize(float64(need+1<<20)))
	}
	return room, nil
}
