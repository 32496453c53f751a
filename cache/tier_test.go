package cache

import (
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"testing"
)

// zipfRows draws row ids of a table of n rows with P(rank r) ∝ 1/r^s. s may be
// below 1 (math/rand's Zipf needs s > 1): it inverts a precomputed CDF. Ranks
// map to rows through a fixed random permutation, so hot rows are scattered
// over the table as hashed n-gram ids are.
type zipfRows struct {
	cdf  []float64
	perm []uint64
}

var (
	zipfMu    sync.Mutex
	zipfCache = map[[2]float64]*zipfRows{}
)

func newZipfRows(n int, s float64) *zipfRows {
	zipfMu.Lock()
	defer zipfMu.Unlock()
	if z := zipfCache[[2]float64{float64(n), s}]; z != nil {
		return z
	}
	z := &zipfRows{cdf: make([]float64, n), perm: make([]uint64, n)}
	sum := 0.0
	for r := range n {
		sum += 1 / math.Pow(float64(r+1), s)
		z.cdf[r] = sum
	}
	for r := range z.cdf {
		z.cdf[r] /= sum
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i, p := range rng.Perm(n) {
		z.perm[i] = uint64(p)
	}
	zipfCache[[2]float64{float64(n), s}] = z
	return z
}

func (z *zipfRows) row(rng *rand.Rand) uint64 {
	i := sort.SearchFloat64s(z.cdf, rng.Float64())
	return z.perm[min(i, len(z.perm)-1)]
}

// decodeStep appends the pages of one decode step (one row per page).
func (z *zipfRows) decodeStep(rng *rand.Rand, rows int, dst []PageKey) []PageKey {
	for range rows {
		dst = append(dst, PageKey{Page: z.row(rng)})
	}
	return dst
}

// scanPages returns n distinct pages of a table of rows rows, in random
// order: one prefill pass.
func scanPages(rng *rand.Rand, rows, n int) []PageKey {
	seen := make(map[uint64]struct{}, n)
	ks := make([]PageKey, 0, n)
	for len(ks) < n {
		p := rng.Uint64N(uint64(rows))
		if _, ok := seen[p]; !ok {
			seen[p] = struct{}{}
			ks = append(ks, PageKey{Page: p})
		}
	}
	return ks
}

func pk(p uint64) PageKey { return PageKey{Page: p} }

// segmentOf says where k is in a tier.
func segmentOf(t *Tier, k PageKey) string { return t.segmentOf(k) }

func access(t *Tier, sig Signal, ks ...PageKey) Changes {
	var c Changes
	t.Access(ks, sig, &c)
	return c
}

// tenPages is a one-stripe tier of 10 pages, 2 of them probation's reserve
// (8 protected at most), that admits every prefill page: the unit tests of
// the transitions fix the tuning they rely on.
func tenPages(t *testing.T) *Tier {
	tr := newTier(10*PageSize, tierOptions{probationPermille: 200, ghostPermille: 1000, admitPrefill: prefillAll})
	if len(tr.stripes) != 1 || tr.Capacity() != 10 || tr.stripes[0].protectedMax != 8 {
		t.Fatalf("tier of 10 pages: %d stripes, capacity %d, protectedMax %d", len(tr.stripes), tr.Capacity(), tr.stripes[0].protectedMax)
	}
	return tr
}

func TestTierNewPageEntersProbation(t *testing.T) {
	for _, sig := range []Signal{SignalDecode, SignalFault, SignalPrefill} {
		tr := tenPages(t)
		c := access(tr, sig, pk(1))
		if !slices.Equal(c.Pin, []PageKey{pk(1)}) || len(c.Unpin) != 0 || c.Misses != 1 || c.Hits != 0 {
			t.Fatalf("signal %d: first access: %+v", sig, c)
		}
		if got := segmentOf(tr, pk(1)); got != "probation" {
			t.Fatalf("signal %d: new page in %s, want probation", sig, got)
		}
	}
}

// TestTierPrefillAdmitsRememberedPages checks the default rule: a prefill
// miss enters probation only when the ghost list remembers the page.
func TestTierPrefillAdmitsRememberedPages(t *testing.T) {
	tr := NewTier(10 * PageSize)
	if c := access(tr, SignalPrefill, pk(1)); len(c.Pin) != 0 || c.Misses != 1 || tr.Contains(pk(1)) {
		t.Fatalf("prefill of an unknown page: %+v, in tier %v", c, tr.Contains(pk(1)))
	}
	access(tr, SignalDecode, pk(1))
	for p := uint64(100); p < 110; p++ {
		access(tr, SignalDecode, pk(p))
	}
	if got := segmentOf(tr, pk(1)); got != "ghost" {
		t.Fatalf("page 1 in %s, want ghost", got)
	}
	if c := access(tr, SignalPrefill, pk(1)); !slices.Equal(c.Pin, []PageKey{pk(1)}) || segmentOf(tr, pk(1)) != "probation" {
		t.Fatalf("prefill of a remembered page: %+v, page in %s, want probation", c, segmentOf(tr, pk(1)))
	}
}

func TestTierProbationHitPromotes(t *testing.T) {
	for _, sig := range []Signal{SignalDecode, SignalFault} {
		tr := tenPages(t)
		access(tr, SignalDecode, pk(1))
		c := access(tr, sig, pk(1))
		if len(c.Pin)+len(c.Unpin) != 0 || c.Hits != 1 || c.Misses != 0 {
			t.Fatalf("signal %d: hit: %+v", sig, c)
		}
		if got := segmentOf(tr, pk(1)); got != "protected" {
			t.Fatalf("signal %d: page hit in probation is in %s, want protected", sig, got)
		}
	}
}

func TestTierPrefillNeverPromotes(t *testing.T) {
	tr := tenPages(t)
	access(tr, SignalPrefill, pk(1))
	c := access(tr, SignalPrefill, pk(1))
	if c.Hits != 1 || segmentOf(tr, pk(1)) != "probation" {
		t.Fatalf("prefill hit in probation: %+v, page in %s", c, segmentOf(tr, pk(1)))
	}
	// Evict page 1 to the ghost list, then prefill it again: probation, not protected.
	for p := uint64(100); p < 110; p++ {
		access(tr, SignalPrefill, pk(p))
	}
	if got := segmentOf(tr, pk(1)); got != "ghost" {
		t.Fatalf("page 1 in %s after 10 newer pages, want ghost", got)
	}
	access(tr, SignalPrefill, pk(1))
	if got := segmentOf(tr, pk(1)); got != "probation" {
		t.Fatalf("prefill ghost hit put the page in %s, want probation", got)
	}
}

func TestTierGhostHitProtects(t *testing.T) {
	tr := tenPages(t)
	access(tr, SignalDecode, pk(1))
	var unpinned []PageKey
	for p := uint64(100); p < 110; p++ {
		unpinned = append(unpinned, access(tr, SignalDecode, pk(p)).Unpin...)
	}
	if !slices.Equal(unpinned, []PageKey{pk(1)}) || segmentOf(tr, pk(1)) != "ghost" {
		t.Fatalf("11 pages in 10: unpinned %v, page 1 in %s", unpinned, segmentOf(tr, pk(1)))
	}
	c := access(tr, SignalFault, pk(1))
	if !slices.Equal(c.Pin, []PageKey{pk(1)}) || !slices.Equal(c.Unpin, []PageKey{pk(100)}) || c.Misses != 1 {
		t.Fatalf("ghost hit: %+v, want pin 1, unpin 100 (probation LRU)", c)
	}
	if got := segmentOf(tr, pk(1)); got != "protected" {
		t.Fatalf("ghost hit put the page in %s, want protected", got)
	}
}

func TestTierProtectedOverflowDemotes(t *testing.T) {
	tr := tenPages(t)
	for p := uint64(0); p < 9; p++ { // 9 > protectedMax = 8
		access(tr, SignalDecode, pk(p))
		access(tr, SignalDecode, pk(p))
	}
	if got := segmentOf(tr, pk(0)); got != "probation" {
		t.Fatalf("protected LRU page in %s after overflow, want probation", got)
	}
	for p := uint64(1); p < 9; p++ {
		if got := segmentOf(tr, pk(p)); got != "protected" {
			t.Fatalf("page %d in %s, want protected", p, got)
		}
	}
	// The demoted page went to probation's MRU end: a new page evicts older
	// probation pages first. 9 pages, probation {0}: a 10th fits, an 11th
	// evicts page 0 (older than page 50 in probation).
	if c := access(tr, SignalDecode, pk(50)); len(c.Unpin) != 0 {
		t.Fatalf("unpinned %v within budget", c.Unpin)
	}
	if c := access(tr, SignalDecode, pk(51)); !slices.Equal(c.Unpin, []PageKey{pk(0)}) {
		t.Fatalf("over budget: unpinned %v, want the demoted page 0 (oldest in probation)", c.Unpin)
	}
}

func TestTierPrefillNeverDisplacesProtected(t *testing.T) {
	tr := tenPages(t)
	for p := uint64(0); p < 8; p++ {
		access(tr, SignalDecode, pk(p), pk(p))
	}
	var scan []PageKey
	for p := uint64(1000); p < 2000; p++ {
		scan = append(scan, pk(p))
	}
	c := access(tr, SignalPrefill, scan...)
	for p := uint64(0); p < 8; p++ {
		if got := segmentOf(tr, pk(p)); got != "protected" {
			t.Fatalf("page %d in %s after a prefill scan, want protected", p, got)
		}
	}
	// The call admitted and evicted most of the scan itself: it reports only
	// the net effect, the last 2 pages.
	if !slices.Equal(c.Pin, []PageKey{pk(1998), pk(1999)}) || len(c.Unpin) != 0 || c.Misses != 1000 {
		t.Fatalf("scan of 1000 through a 2-page probation: pin %v, unpin %v, misses %d", c.Pin, c.Unpin, c.Misses)
	}
}

func TestTierCancelsWithinOneCall(t *testing.T) {
	tr := tenPages(t)
	for p := uint64(0); p < 10; p++ {
		access(tr, SignalPrefill, pk(p))
	}
	// Evict 0 and 1 (probation LRU), then re-admit both from the ghost list in
	// the same call: they never stop being pinned, so neither list names them.
	c := access(tr, SignalDecode, pk(20), pk(21), pk(0), pk(1))
	if slices.Contains(c.Pin, pk(0)) || slices.Contains(c.Unpin, pk(0)) || slices.Contains(c.Pin, pk(1)) || slices.Contains(c.Unpin, pk(1)) {
		t.Fatalf("evicted and re-admitted within one call, yet reported: %+v", c)
	}
	if !tr.Contains(pk(0)) || !tr.Contains(pk(1)) || tr.Len() != 10 {
		t.Fatalf("pages 0, 1 should be in the tier of 10: len %d", tr.Len())
	}
}

func TestTierDisabled(t *testing.T) {
	for _, capBytes := range []int64{0, PageSize - 1, -1} {
		tr := NewTier(capBytes)
		c := access(tr, SignalDecode, pk(1), pk(1))
		if len(c.Pin)+len(c.Unpin)+c.Hits+c.Misses != 0 || tr.Contains(pk(1)) || tr.Len() != 0 || tr.Keys() != nil {
			t.Fatalf("capacity %d: disabled tier did something: %+v", capBytes, c)
		}
		tr.Remove(pk(1))
	}
}

func TestTierRemove(t *testing.T) {
	tr := tenPages(t)
	access(tr, SignalDecode, pk(1), pk(2), pk(2))
	tr.Remove(pk(1))
	tr.Remove(pk(2))
	tr.Remove(pk(3))
	if tr.Len() != 0 || tr.Contains(pk(1)) || tr.Contains(pk(2)) {
		t.Fatalf("after Remove: len %d", tr.Len())
	}
	if c := access(tr, SignalDecode, pk(1)); !slices.Equal(c.Pin, []PageKey{pk(1)}) {
		t.Fatalf("re-access after Remove: %+v", c)
	}
}

func TestTierStripesSumToBudget(t *testing.T) {
	for _, pages := range []int64{1, 7, 511, 1024, 8191, 8192, 100_003, 1 << 20} {
		tr := NewTier(pages*PageSize + PageSize/2)
		n := len(tr.stripes)
		if tr.Capacity() != int(pages) || n&(n-1) != 0 || n > maxStripes {
			t.Errorf("%d pages: capacity %d over %d stripes", pages, tr.Capacity(), n)
		}
	}
}

// TestTierBudgetProperty runs random operation sequences against a model of
// the executor and checks after every call that the model equals the tier,
// that the budget holds, and that Changes never asks to pin a pinned page or
// unpin an unpinned one.
func TestTierBudgetProperty(t *testing.T) {
	for seed := range uint64(12) {
		rng := rand.New(rand.NewPCG(seed, 7))
		pages := int64(1 + rng.IntN(80))
		o := defaultTierOptions()
		o.stripes = 1 << rng.IntN(3)
		o.probationPermille = 50 + rng.IntN(500)
		o.ghostPermille = rng.IntN(2000)
		o.admitPrefill = prefillAdmission(rng.IntN(3))
		tr := newTier(pages*PageSize, o)
		keySpace := uint64(3*pages + 2)
		pinned := map[PageKey]bool{}
		var c Changes
		for op := range 1000 {
			if rng.IntN(20) == 0 {
				k := PageKey{Table: rng.Uint32N(2), Page: rng.Uint64N(keySpace)}
				tr.Remove(k)
				delete(pinned, k)
			} else {
				ks := make([]PageKey, 1+rng.IntN(int(2*pages)+2))
				for i := range ks {
					ks[i] = PageKey{Table: rng.Uint32N(2), Page: rng.Uint64N(keySpace)}
				}
				c.Reset()
				tr.Access(ks, Signal(rng.IntN(3)), &c)
				if c.Hits+c.Misses != len(ks) {
					t.Fatalf("seed %d op %d: %d hits + %d misses for %d keys", seed, op, c.Hits, c.Misses, len(ks))
				}
				unpinned := map[PageKey]bool{}
				for _, k := range c.Unpin {
					if !pinned[k] || unpinned[k] || tr.Contains(k) {
						t.Fatalf("seed %d op %d: unpin of %v, not pinned or in the tier", seed, op, k)
					}
					unpinned[k] = true
					delete(pinned, k)
				}
				for _, k := range c.Pin {
					if pinned[k] || !tr.Contains(k) {
						t.Fatalf("seed %d op %d: pin of %v, already pinned or not in the tier", seed, op, k)
					}
					pinned[k] = true
				}
			}
			keys := tr.Keys()
			if len(keys) > int(pages) || tr.Len() != len(keys) {
				t.Fatalf("seed %d op %d: %d pages in a tier of %d (Len %d)", seed, op, len(keys), pages, tr.Len())
			}
			if len(keys) != len(pinned) {
				t.Fatalf("seed %d op %d: tier has %d pages, executor pinned %d", seed, op, len(keys), len(pinned))
			}
			for _, k := range keys {
				if !pinned[k] {
					t.Fatalf("seed %d op %d: %v in the tier, not pinned", seed, op, k)
				}
			}
		}
	}
}

// TestTierScanResistance warms the tier with a Zipf(0.9) decode trace over 1M
// rows (capacity 2% of the rows), then streams a one-pass scan of 100,000
// distinct pages through it, and checks that the decode-hot set (protected
// before the scan) survives.
func TestTierScanResistance(t *testing.T) {
	const rows = 1_000_000
	z := newZipfRows(rows, 0.9)
	for _, tc := range []struct {
		name  string
		sig   Signal
		batch int
	}{
		{"prefill", SignalPrefill, 10_000}, // a prefill chunk per call
		{"fault", SignalFault, 1},          // faults arrive one page at a time
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(3, 4))
			tr := NewTier(rows / 50 * PageSize)
			var c Changes
			hot := warmProtected(t, tr, z, rng)
			scan := scanPages(rng, rows, 100_000)
			for i := 0; i < len(scan); i += tc.batch {
				tr.Access(scan[i:i+tc.batch], tc.sig, &c)
			}
			kept := 0
			for _, k := range hot {
				if tr.Contains(k) {
					kept++
				}
			}
			t.Logf("%s scan: %d of %d decode-hot pages still pinned (%.1f%%)", tc.name, kept, len(hot), 100*float64(kept)/float64(len(hot)))
			if kept*10 < len(hot)*9 {
				t.Fatalf("%s scan kept %d of %d decode-hot pages, want >= 90%%", tc.name, kept, len(hot))
			}
			if tr.Len() > tr.Capacity() {
				t.Fatalf("%d pages in a tier of %d", tr.Len(), tr.Capacity())
			}
		})
	}
}

// warmProtected runs decode steps until tr's protected segments are full,
// and returns their pages: from then on every page a scan promotes (through
// a ghost hit) demotes a decode-hot page.
func warmProtected(t *testing.T, tr *Tier, z *zipfRows, rng *rand.Rand) []PageKey {
	t.Helper()
	var c Changes
	var step []PageKey
	protectedMax := 0
	for i := range tr.stripes {
		protectedMax += tr.stripes[i].protectedMax
	}
	var hot []PageKey
	for steps := 0; len(hot) < protectedMax*99/100; steps++ {
		if steps == 10_000 {
			t.Fatalf("warm-up protected only %d of %d pages", len(hot), protectedMax)
		}
		step = z.decodeStep(rng, 72, step[:0])
		tr.Access(step, SignalDecode, &c)
		if steps%100 == 0 {
			hot = hot[:0]
			for i := range tr.stripes {
				hot = tr.stripes[i].appendList(hot, segProtected)
			}
		}
	}
	return hot
}

func TestTierConcurrentAccess(t *testing.T) {
	z := newZipfRows(100_000, 0.9)
	tr := NewTier(4096 * PageSize)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	checked := make(chan int)
	go func() { // the budget holds at every moment someone can look
		n := 0
		for {
			select {
			case <-stop:
				checked <- n
				return
			default:
			}
			if l := tr.Len(); l > tr.Capacity() {
				t.Errorf("%d pages in a tier of %d", l, tr.Capacity())
			}
			n++
		}
	}()
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 9))
			var c Changes
			var step []PageKey
			for i := range 600 {
				step = z.decodeStep(rng, 72, step[:0])
				c.Reset()
				tr.Access(step, Signal(i%3), &c)
				if i%50 == 0 {
					tr.Remove(step[0])
					tr.Contains(step[1])
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	t.Logf("budget checked %d times", <-checked)
	keys := tr.Keys()
	seen := map[PageKey]bool{}
	for _, k := range keys {
		if seen[k] {
			t.Fatalf("%v twice in Keys", k)
		}
		seen[k] = true
	}
	if len(keys) != tr.Len() || len(keys) > tr.Capacity() {
		t.Fatalf("%d keys, Len %d, capacity %d", len(keys), tr.Len(), tr.Capacity())
	}
}

// Prefill scans that come back: a chunk is prefilled, then prefilled again
// (a retried request, the next rank's copy) while decode goes on. The second
// pass finds the chunk's pages in probation or on the ghost list, which is
// where the prefill rules matter: a prefill hit never promotes and a
// remembered page re-enters probation, never protected. Each of those rules
// was caught by one unit test alone, and the scans above name each page once.
func TestTierScanResistanceRepeatedPrefill(t *testing.T) {
	const rows = 1_000_000
	z := newZipfRows(rows, 0.9)
	rng := rand.New(rand.NewPCG(5, 6))
	tr := NewTier(rows / 50 * PageSize)
	var c Changes
	var step []PageKey
	hot := warmProtected(t, tr, z, rng)
	hotSet := map[PageKey]bool{}
	for _, k := range hot {
		hotSet[k] = true
	}
	for range 20 {
		chunk := scanPages(rng, rows, 5_000)
		for range 3 { // the chunk, then the same chunk twice more
			tr.Access(chunk, SignalPrefill, &c)
		}
		for range 5 {
			step = z.decodeStep(rng, 72, step[:0])
			tr.Access(step, SignalDecode, &c)
		}
	}
	kept, protectedScan := 0, 0
	for _, k := range hot {
		if tr.Contains(k) {
			kept++
		}
	}
	var prot []PageKey
	for i := range tr.stripes {
		prot = tr.stripes[i].appendList(prot, segProtected)
	}
	for _, k := range prot {
		if !hotSet[k] {
			protectedScan++
		}
	}
	t.Logf("repeated prefill scans: %d of %d decode-hot pages kept; %d of %d protected pages are new", kept, len(hot), protectedScan, len(prot))
	if kept*10 < len(hot)*9 {
		t.Fatalf("repeated prefill scans kept %d of %d decode-hot pages, want >= 90%%", kept, len(hot))
	}
	if protectedScan*10 > len(prot) {
		t.Fatalf("%d of %d protected pages came in with the scans, want <= 10%%: prefill promoted pages", protectedScan, len(prot))
	}
}
