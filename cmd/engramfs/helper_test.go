package main

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/engramfs/engramfs/internal/stats"
)

func TestParseHelperArgsAsMountRunsIt(t *testing.T) {
	// mount(8): mount.<type> spec dir [-sfnv] [-N ns] [-o options] [-t type.subtype]
	h, err := parseHelperArgs([]string{"/models/m", "/mnt/e", "-n", "-o", "rw,cache_size=8M,,allow_other", "-t", "fuse.engramfs"})
	if err != nil {
		t.Fatal(err)
	}
	if h.source != "/models/m" || h.target != "/mnt/e" || !slices.Equal(h.options, []string{"rw", "cache_size=8M", "allow_other"}) {
		t.Fatalf("parsed %+v", h)
	}
	h, err = parseHelperArgs([]string{"-sfv", "-ocache_size=1G", "a", "b"})
	if err != nil || !h.sloppy || !h.fake || !h.verbose || h.options[0] != "cache_size=1G" {
		t.Fatalf("parsed %+v, %v", h, err)
	}
	for _, bad := range [][]string{
		{"a"}, {"a", "b", "c"}, {"a", "b", "-o"}, {"a", "b", "-t", "ext4"}, {"a", "b", "-N", "/proc/1/ns/mnt"}, {"a", "b", "-x"},
	} {
		if _, err := parseHelperArgs(bad); err == nil {
			t.Errorf("%q was accepted", bad)
		}
	}
}

func TestMountArgsTranslatesOptions(t *testing.T) {
	var warn bytes.Buffer
	flags, logFile, err := mountArgs(helperArgs{options: []string{
		"defaults", "rw", "nosuid", "nodev", "noexec", "auto", "user", "_netdev", "nofail", "x-systemd.requires=nfs.mount",
		"cache_size=4G", "queue_depth=32", "allow_other", "state_file=/var/lib/engramfs/m.state",
		"metrics_addr=127.0.0.1:9464", "log_file=/tmp/x.log", "debug_fuse=false",
	}}, &warn)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"--cache-size=4G", "--queue-depth=32", "--allow-other", "--state-file=/var/lib/engramfs/m.state",
		"--metrics-addr=127.0.0.1:9464", "--debug-fuse=false"}
	if !slices.Equal(flags, want) || logFile != "/tmp/x.log" {
		t.Fatalf("flags %q log %q; want %q and /tmp/x.log", flags, logFile, want)
	}
	for _, bad := range []string{"cache-size=4G", "bogus=1", "queue_depth=many", "cache_size", "log_file="} {
		if _, _, err := mountArgs(helperArgs{options: []string{bad}}, &warn); err == nil {
			t.Errorf("option %q was accepted", bad)
		} else if bad == "bogus=1" && !strings.Contains(err.Error(), "cache_size") {
			t.Errorf("the error for an unknown option does not list the known ones: %v", err)
		}
	}
	// -s (sloppy): unknown options are ignored with a warning.
	warn.Reset()
	flags, _, err = mountArgs(helperArgs{sloppy: true, options: []string{"bogus=1", "cache_size=1G"}}, &warn)
	if err != nil || !slices.Equal(flags, []string{"--cache-size=1G"}) || !strings.Contains(warn.String(), "bogus") {
		t.Fatalf("sloppy: flags %q, err %v, warning %q", flags, err, warn.String())
	}
}

func TestLogName(t *testing.T) {
	for in, want := range map[string]string{"/mnt/engram/": "mnt-engram", "/": "root", "/a/b/c": "a-b-c"} {
		if got := logName(in); got != want {
			t.Errorf("logName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestWatchRates(t *testing.T) {
	prev := stats.Snapshot{FuseReads: 100, CacheHits: 10, CacheMisses: 10, BackingBytes: 0, PrefetchPagesStored: 0, HintRows: 0}
	cur := stats.Snapshot{FuseReads: 300, CacheHits: 100, CacheMisses: 20, BackingBytes: 4e6, PrefetchPagesStored: 1000, HintRows: 500, PrefetchLate: 4}
	r := computeRates(cur, prev, 2*time.Second)
	if r.faults != 100 || r.backingMBps != 2 || r.pagesPushed != 500 || r.rowsHinted != 250 || r.late != 2 || r.hitRatio != 0.9 {
		t.Fatalf("rates %+v", r)
	}
	// A restarted daemon (counters back to zero) gives no negative rate.
	if r := computeRates(prev, cur, time.Second); r.faults != 0 || r.hitRatio != -1 {
		t.Fatalf("rates across a restart: %+v", r)
	}
	var b bytes.Buffer
	renderStats(&b, "/mnt/e", cur, &prev, 2*time.Second)
	for _, want := range []string{"100 faults/s", "hit ratio 90.0%", "backing 2.0 MB/s", "500 pages/s", "2 late prefetches/s", "fuse_reads"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("the watch table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestWatchFlag(t *testing.T) {
	var w watchFlag
	if err := w.Set("true"); err != nil || !w.on || w.interval != defaultWatchInterval {
		t.Fatalf("--watch: %+v %v", w, err)
	}
	for in, want := range map[string]time.Duration{"2s": 2 * time.Second, "0.5": 500 * time.Millisecond, "250ms": 250 * time.Millisecond} {
		if err := w.Set(in); err != nil || w.interval != want {
			t.Errorf("--watch=%s: %v %v, want %v", in, w.interval, err, want)
		}
	}
	for _, bad := range []string{"soon", "1ms", "-1s"} {
		if err := w.Set(bad); err == nil {
			t.Errorf("--watch=%s accepted", bad)
		}
	}
}
