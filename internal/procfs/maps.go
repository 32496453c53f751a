package procfs

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Mappers returns the pids of the processes that map a file under path (a
// mountpoint or a file), from every /proc/PID/maps this process may read,
// in ascending order. A process that exits while it is read is skipped.
// A mapping keeps a FUSE file's pages reachable after its daemon is gone:
// its next cold page is SIGBUS, so a stop must know who maps.
func Mappers(path string) ([]int, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(Root)
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(PidPath(pid, "maps"))
		if err != nil {
			continue // gone, or not ours to read
		}
		if MapsUnder(b, abs) {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	return pids, nil
}

// MapsUnder reports whether the text of a maps file has a mapping of a file
// at or under dir. The path is the sixth field; a deleted file's path ends
// in " (deleted)", which still names where it was.
func MapsUnder(maps []byte, dir string) bool {
	dir = filepath.Clean(dir)
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		f := strings.SplitN(sc.Text(), " ", 6)
		if len(f) < 6 {
			continue
		}
		p := strings.TrimSpace(f[5])
		if p == dir || strings.HasPrefix(p, dir+"/") || dir == "/" && strings.HasPrefix(p, "/") {
			return true
		}
	}
	return false
}
