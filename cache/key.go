package cache

import "github.com/engramfs/engramfs/backing"

// PageSize is the unit of everything engramfs caches, fetches and pins: one
// kernel page. A fault costs exactly one page of backing I/O. It is the
// page the table files are laid out in (backing.PageSize): one value.
const PageSize = backing.PageSize

// PageKey names one 4096-byte page of one table file of the mount.
type PageKey struct {
	Table uint32
	Page  uint64
}
