package procfs

import (
	"os"
	"strconv"
	"strings"
)

// Mount is one line of /proc/self/mountinfo.
type Mount struct {
	// ID is the mount's unique ID (reused only once it is unmounted), and
	// Parent the ID of the mount it sits on: for two mounts stacked on one
	// path, the upper one's Parent is the lower one's ID.
	ID, Parent int
	Dev        string // the filesystem's device, "MAJ:MIN" (0:N for FUSE)
	Point      string // where it is mounted, octal escapes decoded
	FSType     string // e.g. "fuse.engramfs", "ext4"
	Source     string // e.g. "/dev/vda", or what the FUSE daemon named it
	// Root is the directory of the filesystem mounted at Point ("/" for
	// all of it; a cgroup namespace's own part of a hierarchy).
	Root string
	// Options are the super options: for a v1 cgroup hierarchy they name
	// its controllers ("rw,memory").
	Options string
}

// Mounts is this process's mount table (its mount namespace), from
// /proc/self/mountinfo.
func Mounts() ([]Mount, error) {
	b, err := os.ReadFile(Root + "/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return ParseMountinfo(b), nil
}

// ParseMountinfo parses the text of a mountinfo file: "ID PARENT MAJ:MIN
// ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS". Lines
// not of that form are skipped.
func ParseMountinfo(b []byte) []Mount {
	var ms []Mount
	for _, line := range strings.Split(string(b), "\n") {
		if line == "" {
			continue
		}
		f := strings.Fields(line)
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if len(f) < 5 || sep < 0 || sep+2 >= len(f) {
			continue // not a mount line: the kernel writes none
		}
		m := Mount{Point: unescape(f[4]), FSType: f[sep+1], Source: unescape(f[sep+2]), Root: unescape(f[3]), Dev: f[2]}
		m.ID, _ = strconv.Atoi(f[0])
		m.Parent, _ = strconv.Atoi(f[1])
		if sep+3 < len(f) {
			m.Options = f[sep+3]
		}
		ms = append(ms, m)
	}
	return ms
}

// unescape decodes the octal escapes (\040 for a space, \011, \012, \134)
// the kernel writes in mountinfo paths.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

// Mounted reports whether mp is a mountpoint in this mount namespace. An
// unreadable mount table counts as not mounted.
func Mounted(mp string) bool {
	ms, err := Mounts()
	if err != nil {
		return false
	}
	for _, m := range ms {
		if m.Point == mp {
			return true
		}
	}
	return false
}

// MountsUnder is the mountpoints at or below dir: with dir a directory of
// this run's own, what it left mounted, whatever other processes mount
// elsewhere meanwhile.
func MountsUnder(dir string) ([]string, error) {
	ms, err := Mounts()
	if err != nil {
		return nil, err
	}
	prefix := strings.TrimSuffix(dir, "/") + "/"
	var out []string
	for _, m := range ms {
		if m.Point == dir || strings.HasPrefix(m.Point, prefix) {
			out = append(out, m.Point)
		}
	}
	return out, nil
}

// Top is the mount a lookup of path reaches: of the mounts at path, the
// one no other mount at path sits on (the most recently stacked). ok is
// false when nothing is mounted at path. path must be clean and absolute,
// as mountinfo writes it.
func Top(ms []Mount, path string) (top Mount, ok bool) {
	for _, m := range ms {
		if m.Point == path && !covered(ms, m) {
			return m, true
		}
	}
	return Mount{}, false
}

// ByID is the mount with the given ID; ok is false when it is no longer
// in the table (unmounted, or detached lazily).
func ByID(ms []Mount, id int) (m Mount, ok bool) {
	for _, m := range ms {
		if m.ID == id {
			return m, true
		}
	}
	return Mount{}, false
}

// Covering is the mount stacked on m at m's own mountpoint, if any: what
// hides m from a lookup of its path without detaching it.
func Covering(ms []Mount, m Mount) (Mount, bool) {
	for _, c := range ms {
		if c.Parent == m.ID && c.Point == m.Point && c.ID != m.ID {
			return c, true
		}
	}
	return Mount{}, false
}

func covered(ms []Mount, m Mount) bool {
	_, ok := Covering(ms, m)
	return ok
}
