package bench

import (
	"math"
	"slices"
	"time"
)

// Percentile returns the p-th percentile (0 <= p <= 100) of samples by
// linear interpolation between the closest ranks (numpy's default), or 0 for
// no samples. samples need not be sorted; they are not modified.
func Percentile(samples []time.Duration, p float64) time.Duration {
	if len(samples) == 0 {
		return 0
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	return percentileSorted(s, p)
}

func percentileSorted(s []time.Duration, p float64) time.Duration {
	p = min(max(p, 0), 100)
	pos := p / 100 * float64(len(s)-1)
	lo := int(math.Floor(pos))
	hi := min(lo+1, len(s)-1)
	frac := pos - float64(lo)
	return s[lo] + time.Duration(math.Round(frac*float64(s[hi]-s[lo])))
}

// Summary is the distribution of a set of timings.
type Summary struct {
	N    int           `json:"n"`
	Mean time.Duration `json:"mean_ns"`
	P50  time.Duration `json:"p50_ns"`
	P90  time.Duration `json:"p90_ns"`
	P99  time.Duration `json:"p99_ns"`
	Max  time.Duration `json:"max_ns"`
	Sum  time.Duration `json:"sum_ns"`
}

// Summarize computes the summary of samples.
func Summarize(samples []time.Duration) Summary {
	if len(samples) == 0 {
		return Summary{}
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return Summary{
		N: len(s), Sum: sum, Mean: sum / time.Duration(len(s)),
		P50: percentileSorted(s, 50), P90: percentileSorted(s, 90), P99: percentileSorted(s, 99),
		Max: s[len(s)-1],
	}
}
