package stats

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// RelPath is where a mount publishes its Snapshot, relative to the
// mountpoint: the read-only file .engramfs/stats.
const RelPath = ".engramfs/stats"

// ReadFile reads and decodes the stats file of the engramfs mount at
// mountpoint. It is the one reader of that file (the CLI, the tests and the
// bench all use it).
func ReadFile(mountpoint string) (Snapshot, error) {
	var s Snapshot
	p := filepath.Join(mountpoint, RelPath)
	b, err := os.ReadFile(p)
	if err != nil {
		return s, fmt.Errorf("%s: not an engramfs mount? %w", mountpoint, err)
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("%s: stats are not JSON: %w", p, err)
	}
	return s, nil
}
