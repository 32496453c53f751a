package bench

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/engramfs/engramfs/backing"
)

func TestParseDevStat(t *testing.T) {
	c, err := parseDevStat([]byte(" 3343126    83118 47207365  9819160    38127    59459 26286360   219053        0   298700 10054071    22256       46 10432488    15664     2937      192\n"))
	if err != nil || c != (DevCounters{Reads: 3343126, ReadMerges: 83118, ReadSectors: 47207365}) {
		t.Errorf("parse: %+v, %v", c, err)
	}
	if c.Bytes() != 47207365*512 {
		t.Errorf("bytes %d", c.Bytes())
	}
	if d := c.Sub(DevCounters{Reads: 3343120, ReadMerges: 83000, ReadSectors: 47207000}); d != (DevCounters{Reads: 6, ReadMerges: 118, ReadSectors: 365}) {
		t.Errorf("sub: %+v", d)
	}
	for _, bad := range []string{"", "1 2 3", "1 x 3 4 5 6 7 8 9 10 11"} {
		if _, err := parseDevStat([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// TestBlockDevCountsReads: the device under a temporary directory is found,
// and an O_DIRECT read of a file there shows in its counters (other
// processes' reads may add to them, never take away).
func TestBlockDevCountsReads(t *testing.T) {
	dir := t.TempDir()
	dev, err := FindBlockDev(dir)
	if err != nil {
		t.Skipf("no block device under %s: %v", dir, err)
	}
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, make([]byte, 64<<10), 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Skipf("O_DIRECT: %v", err)
	}
	defer unix.Close(fd)
	before, err := dev.Read()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Pread(fd, backing.AlignedBuf(64<<10, 4096), 0); err != nil {
		t.Fatal(err)
	}
	after, err := dev.Read()
	if err != nil {
		t.Fatal(err)
	}
	if d := after.Sub(before); d.Reads < 1 || d.Bytes() < 64<<10 {
		t.Errorf("%s: a 64 KiB O_DIRECT read counted as %+v", dev.Name, d)
	}
}
