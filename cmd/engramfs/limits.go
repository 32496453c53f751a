package main

import (
	"fmt"

	units "github.com/docker/go-units"

	"github.com/engramfs/engramfs/backing/s3source"
	"github.com/engramfs/engramfs/internal/nofile"
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
