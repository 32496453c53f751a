package cache

// PageSize is the unit of everything engramfs caches, fetches and pins: one
// kernel page. A fault costs exactly one page of backing I/O.
const PageSize = 4096

// PageKey names one 4096-byte page of one table file of the mount.
type PageKey struct {
	Table uint32
	Page  uint64
}
