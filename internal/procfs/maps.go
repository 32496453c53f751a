package procfs

import (
	"bufio"
	"bytes"
	"os"
	"slices"
	"strconv"
	"strings"
)

// Mapper is a process that maps files under a directory (a mount).
type Mapper struct {
	Pid   int
	Comm  string   // its command name, /proc/PID/comm
	Files []string // the files it maps there, each once, sorted
}

// Mappers is every process that maps a file under dir (a mountpoint,
// clean and absolute), from /proc/*/maps, by pid. A process that exits
// while it is read, or whose maps this process may not read (another
// user's, without root), is skipped: the answer is what could be seen.
// A mapping of a mount that was detached lazily is shown by the kernel
// under another path and is not found.
func Mappers(dir string) ([]Mapper, error) {
	ents, err := os.ReadDir(Root)
	if err != nil {
		return nil, err
	}
	prefix := strings.TrimSuffix(dir, "/") + "/"
	var out []Mapper
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		b, err := os.ReadFile(PidPath(pid, "maps"))
		if err != nil {
			continue // exited meanwhile, or not ours to read
		}
		files := MappedUnder(b, prefix)
		if len(files) == 0 {
			continue
		}
		comm, _ := os.ReadFile(PidPath(pid, "comm"))
		out = append(out, Mapper{Pid: pid, Comm: strings.TrimSpace(string(comm)), Files: files})
	}
	return out, nil
}

// MappedUnder is the files under prefix (a directory path ending in "/")
// that the text of a /proc/PID/maps file maps, each once, sorted.
func MappedUnder(maps []byte, prefix string) []string {
	var files []string
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		if p := mapsPath(sc.Text()); strings.HasPrefix(p, prefix) {
			files = append(files, p)
		}
	}
	slices.Sort(files)
	return slices.Compact(files)
}

// mapsPath is the path of a maps line "ADDR PERMS OFFSET DEV INODE   PATH"
// ("" for an anonymous mapping); the path may hold spaces.
func mapsPath(line string) string {
	rest := line
	for range 5 {
		rest = strings.TrimLeft(rest, " ")
		i := strings.IndexByte(rest, ' ')
		if i < 0 {
			return ""
		}
		rest = rest[i:]
	}
	return strings.TrimLeft(rest, " ")
}
