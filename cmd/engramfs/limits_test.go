package main

import (
	"strings"
	"testing"

	"github.com/engramfs/engramfs/internal/memcg"
)

// TestFitTier: a tier that fits its memory cgroup with headroom is kept, a
// larger one is clamped to what fits, and where not even the smallest
// tier fits the error names the limit, its file and both ways out; no
// limit, or no tier, changes nothing.
func TestFitTier(t *testing.T) {
	l := func(b int64) memcg.Limit {
		return memcg.Limit{Bytes: b, Dir: "/sys/fs/cgroup/system.slice/engramfs.service", File: "memory.max"}
	}
	for _, c := range []struct {
		capacity int64
		limit    memcg.Limit
		want     int64
	}{
		{1 << 30, memcg.Limit{}, 1 << 30},               // no limit
		{0, l(48 << 20), 0},                             // no tier
		{128 << 20, l(256 << 20), 128 << 20},            // fits
		{1 << 30, l(256 << 20), 160 << 20},              // 256 MiB less 64 + 32
		{8 << 30, l(4 << 30), 4<<30 - 64<<20 - 512<<20}, // 4 GiB less 64 MiB + 1/8
	} {
		got, err := fitTier(c.capacity, c.limit)
		if err != nil || got != c.want {
			t.Errorf("fitTier(%d, %d) = %d, %v; want %d", c.capacity, c.limit.Bytes, got, err, c.want)
		}
		if got > 0 && c.limit.Bytes > 0 && got+memcgHeadroom(c.limit.Bytes) > c.limit.Bytes {
			t.Errorf("fitTier(%d, %d) = %d leaves less than the headroom", c.capacity, c.limit.Bytes, got)
		}
	}
	_, err := fitTier(1<<30, l(80<<20))
	if err == nil {
		t.Fatal("a 1 GiB tier in an 80 MiB group was taken")
	}
	for _, s := range []string{"80MiB", "engramfs.service/memory.max", "MemoryMax=", "--cache-size 0"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("refusal %q does not say %q", err, s)
		}
	}
	// The limit the refusal asks for is enough.
	if _, err := fitTier(1<<30, l(93<<20)); err != nil {
		t.Errorf("93 MiB (the least the refusal names, rounded up): %v", err)
	}
}
