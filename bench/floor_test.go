package bench

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestBurstFloorAt(t *testing.T) {
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	// The fio table: 0.05/0.32/0.66/1.12/2.4/4.2 ms at 1/8/16/32/64/128.
	f := &BurstFloor{Points: []BurstPoint{{N: 1, P50: ms(0.05)}, {N: 8, P50: ms(0.32)}, {N: 16, P50: ms(0.66)},
		{N: 32, P50: ms(1.12)}, {N: 64, P50: ms(2.4)}, {N: 128, P50: ms(4.2)}}}
	for _, tc := range []struct {
		n    float64
		want time.Duration
	}{
		{0, 0},
		{-3, 0},
		{0.5, ms(0.025)},        // from 0 at n = 0
		{1, ms(0.05)},           // a measured point
		{12, ms(0.49)},          // halfway between 8 and 16
		{54, ms(1.12 + 0.88)},   // 22/32 of the way from 32 to 64: 1.12 + 1.28 × 22/32
		{128, ms(4.2)},          // the last point
		{192, ms(4.2 + 1.8)},    // past it along the last slope (1.8 ms per 64)
		{64 + 1e-9, ms(2.4)},    // continuous at a point
		{96, ms(2.4 + 1.8*0.5)}, // between the last two
	} {
		if got := f.At(tc.n); absDur(got-tc.want) > time.Microsecond {
			t.Errorf("At(%v) = %v, want %v", tc.n, got, tc.want)
		}
	}
	if got := (&BurstFloor{Points: []BurstPoint{{N: 8, P50: ms(0.4)}}}).At(16); got != ms(0.8) {
		t.Errorf("one point, past it: %v, want its slope from 0 (0.8ms)", got)
	}
	var none *BurstFloor
	if none.At(10) != 0 {
		t.Error("no floor measured, yet a value")
	}
}

func absDur(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}

func TestBestBursts(t *testing.T) {
	a := &BurstFloor{Engine: "io_uring", Points: []BurstPoint{{N: 1, P50: 60 * time.Microsecond}, {N: 8, P50: 400 * time.Microsecond}}}
	b := &BurstFloor{Engine: "io_uring", Points: []BurstPoint{{N: 1, P50: 80 * time.Microsecond}, {N: 8, P50: 300 * time.Microsecond}, {N: 16, P50: time.Millisecond}}}
	got := bestBursts([]*BurstFloor{a, nil, b})
	want := []time.Duration{60 * time.Microsecond, 300 * time.Microsecond, time.Millisecond}
	if len(got.Points) != 3 {
		t.Fatalf("points %+v", got.Points)
	}
	for i, p := range got.Points {
		if p.P50 != want[i] || p.N != []int{1, 8, 16}[i] {
			t.Errorf("point %d = %+v, want p50 %v", i, p, want[i])
		}
	}
	if a.Points[1].P50 != 400*time.Microsecond {
		t.Error("bestBursts changed a run it combined")
	}
}

// TestMeasureBursts reads real bursts with each engine: each size measured
// the runs asked for, latencies positive.
func TestMeasureBursts(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	measured := 0
	for _, engine := range []string{"io_uring", "pread"} {
		f, err := MeasureBursts(context.Background(), []string{path}, []int{8, 1}, 3, engine)
		if err != nil {
			t.Logf("%s: %v", engine, err)
			continue
		}
		measured++
		if f.Engine != engine || len(f.Points) != 2 || f.Points[0].N != 1 || f.Points[1].N != 8 {
			t.Fatalf("floor %+v", f)
		}
		for _, p := range f.Points {
			if p.Runs != 3 || p.P50 <= 0 || p.P99 < p.P50 {
				t.Errorf("%s: point %+v", engine, p)
			}
		}
	}
	if measured == 0 {
		t.Skip("no engine could read O_DIRECT here")
	}
}
