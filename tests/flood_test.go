package tests

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
	"github.com/engramfs/engramfs/internal/procfs"
)

// mustProcBytes reads one "Key: N kB" line of /proc/PID/FILE (status,
// smaps_rollup), in bytes, or fails t.
func mustProcBytes(t testing.TB, pid int, file, key string) int64 {
	t.Helper()
	n, err := procfs.PidKB(pid, file, key)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// VmRSS of pid in bytes.
func rssBytes(t testing.TB, pid int) int64 {
	t.Helper()
	return mustProcBytes(t, pid, "status", "VmRSS")
}

func TestPrefillFloodDropsOldestAndDecodeGoesFirst(t *testing.T) {
	spec := geometries()["flash"]
	spec.Rows = 200000 // 12,500 weight pages, 400 scale pages per layer
	// Slow backing and a small queue: the flood cannot be served in time,
	// so the queue must drop, and decode must overtake it.
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=4ms", "--queue-depth", "4", "--prefetch-queue", "8192")
	maps := layerMaps(t, d, Model(t, d.ModelDir), 0)
	pid := d.Pid()
	rss0 := rssBytes(t, pid)

	flood := openControl(t, d)
	rng := rand.New(rand.NewPCG(20, 21))
	const frames, perFrame = 40, 40000
	for range frames {
		if _, err := flood.Write(hints.AppendBinary(nil, hints.Prefill, 0, randomRows(rng, perFrame, spec.Rows))); err != nil {
			t.Fatal(err)
		}
	}
	mid := d.Stats(t)
	if mid.PrefetchPagesDropped == 0 {
		t.Fatalf("a flood of %d prefill rows into an 8192-page queue dropped nothing: %+v", frames*perFrame, mid)
	}

	// A decode step during the flood: it must not wait for the flood.
	ctl := openControl(t, d)
	rows := randomRows(rng, 72, spec.Rows)
	drops := dropCount(t)
	start := time.Now()
	if _, err := ctl.Write(hints.AppendBinary(nil, hints.Decode, 0, rows)); err != nil {
		t.Fatal(err)
	}
	if err := ctl.Sync(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	after := d.Stats(t)
	// Served first, the decode step waits for its own pages and the prefill
	// runs already in flight (4 workers, runs of up to 256 pages, twice over
	// for the moments around the snapshot); behind the flood it would wait
	// for the whole queue (8192 pages) to be stored first.
	decodePages := 0
	for tb := range maps {
		_, n := rowsResident(t, tb, maps[tb], rows)
		decodePages += n
	}
	stored := after.PrefetchPagesStored - mid.PrefetchPagesStored
	if stored > uint64(decodePages)+2*4*256 {
		t.Fatalf("%d pages were stored before the decode barrier returned, for a decode step of %d pages: decode did not overtake the queued prefill work", stored, decodePages)
	}
	checkHintedResident(t, d, 0, maps, rows, drops, "decode pages after the barrier")
	t.Logf("decode barrier took %v; %d pages stored meanwhile for a %d-page step; %d prefill pages dropped", took, stored, decodePages, after.PrefetchPagesDropped)

	// Memory stays bounded: the flood named millions of pages, the daemon
	// holds only the queue's worth.
	rss := rssBytes(t, pid)
	t.Logf("daemon RSS %d MiB before the flood, %d MiB after", rss0>>20, rss>>20)
	if limit := rss0 + 256<<20; rss > limit {
		t.Fatalf("daemon RSS grew from %d MiB to %d MiB during the flood", rss0>>20, rss>>20)
	}
}

// Decode work is never lost, whatever races it: a prefill flood that keeps
// the queue dropping, readers faulting the same pages (which cancels their
// queued fetches), and decode steps that hint rows again. Every decode
// barrier must find every page it named resident.
func TestNoDecodePageLostInAFlood(t *testing.T) {
	spec := geometries()["flash"]
	spec.Rows = 200000
	d := Mount(t, Synth(t, spec), "--inject-faults", "latency=2ms", "--queue-depth", "4", "--prefetch-queue", "4096")
	m := Model(t, d.ModelDir)
	maps := layerMaps(t, d, m, 0)
	// The flood, on its own handle: never waited for.
	flood, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer flood.Close()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var halt sync.Once
	stopAll := func() { halt.Do(func() { close(stop); wg.Wait() }) }
	defer stopAll()
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(40, 41))
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := flood.Prefill(0, randomRows(rng, 20000, spec.Rows)); err != nil {
				t.Errorf("flood: %v", err)
				return
			}
		}
	}()
	// Readers faulting the rows decode hints, so faults race queued fetches.
	const hotRows = 4000
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(50, uint64(i)))
			var sum byte // Touch's sink is shared: keep this reader's own
			defer func() { _ = sum }()
			for {
				select {
				case <-stop:
					return
				default:
				}
				r := rng.Uint64N(hotRows)
				for tb, b := range maps {
					sum += b[len(tb.FileHeader)+int(r)*int(tb.RowBytes)]
				}
			}
		}()
	}

	h, err := client.Open(d.Mountpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	rng := rand.New(rand.NewPCG(60, 61))
	var prev []uint64
	const steps, mustJudge = 40, 20
	judged := 0
	for step := range steps {
		rows := randomRows(rng, 72, spec.Rows) // cold
		if prev != nil {
			rows = append(rows[:48], prev[:24]...) // hinted again
		}
		prev = rows
		drops := dropCount(t)
		if err := h.Decode(0, rows); err != nil {
			t.Fatal(err)
		}
		// Fault half of them while they wait in the queue: the faults
		// cancel their fetches, and the barrier must still see them land.
		touched := make(chan struct{})
		go func() {
			defer close(touched)
			var sum byte
			for _, r := range rows[:36] {
				for tb, b := range maps {
					sum += b[len(tb.FileHeader)+int(r)*int(tb.RowBytes)]
				}
			}
			_ = sum
		}()
		st, err := h.Barrier()
		<-touched
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		checkStatus(t, fmt.Sprintf("decode step %d", step), st)
		if err := allResident(t, maps, rows); err != nil {
			// A step during which someone else dropped the page cache, or
			// the kernel reclaimed every page it missed, is not judged (the
			// pages did land, and were evicted); otherwise a missing page
			// fails at once.
			if !outsideEviction(t, err, drops) {
				t.Fatalf("step %d: decode pages after the barrier (status %+v): %v", step, st, err)
			}
			t.Logf("step %d not judged: %v; pages were evicted from outside meanwhile", step, err)
			continue
		}
		judged++
	}
	if judged < mustJudge {
		t.Fatalf("only %d of %d steps could be judged (the page cache was dropped from outside during the others)", judged, steps)
	}
	stopAll()
	s := d.Stats(t)
	if s.PrefetchPagesDropped == 0 {
		t.Fatalf("the flood dropped nothing: the test raced nothing (%+v)", s)
	}
	t.Logf("dropped %d prefill pages, %d late (faults that cancelled a queued fetch or caught one in flight), %d failed", s.PrefetchPagesDropped, s.PrefetchLate, s.PrefetchPagesFailed)
}
