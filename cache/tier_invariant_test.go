package cache

import (
	"math/rand/v2"
	"testing"
)

// checkIndex verifies a stripe's structure: every listed slot is indexed
// under its key, the index names only listed slots, list counts add up.
func checkIndex(t *testing.T, s *stripe) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	listed := 0
	for l := range uint8(nSegs) {
		n := 0
		for sl := s.next[l]; sl != uint32(l); sl = s.next[sl] {
			if s.seg[sl] != l {
				t.Fatalf("slot %d on list %d has seg %d", sl, l, s.seg[sl])
			}
			if got := s.lookup(s.key[sl]); got != sl {
				t.Fatalf("slot %d (key %#x) on list %d: lookup gives %d", sl, s.key[sl], l, got)
			}
			n++
		}
		if n != s.n[l] {
			t.Fatalf("list %d has %d slots, count says %d", l, n, s.n[l])
		}
		listed += n
	}
	indexed := 0
	for _, sl := range s.index {
		if sl != 0 {
			indexed++
			if s.seg[sl] == segFree {
				t.Fatalf("index names free slot %d", sl)
			}
		}
	}
	if indexed != listed {
		t.Fatalf("%d slots indexed, %d listed", indexed, listed)
	}
}

func TestTierIndexInvariant(t *testing.T) {
	for seed := range uint64(40) {
		rng := rand.New(rand.NewPCG(seed, 99))
		pages := int64(1 + rng.IntN(3000))
		o := defaultTierOptions()
		o.stripes = 1 << rng.IntN(4)
		o.ghostPermille = rng.IntN(2000)
		o.admitPrefill = prefillAdmission(rng.IntN(3))
		tr := newTier(pages*PageSize, o)
		keySpace := uint64(4*pages + 3)
		var c Changes
		for op := range 3000 {
			if rng.IntN(10) == 0 {
				tr.Remove(PageKey{Table: rng.Uint32N(3), Page: rng.Uint64N(keySpace)})
			}
			ks := make([]PageKey, 1+rng.IntN(100))
			for i := range ks {
				ks[i] = PageKey{Table: rng.Uint32N(3), Page: rng.Uint64N(keySpace)}
			}
			c.Reset()
			tr.Access(ks, Signal(rng.IntN(3)), &c)
			if op%97 == 0 {
				for i := range tr.stripes {
					checkIndex(t, &tr.stripes[i])
				}
				n := 0
				for i := range tr.stripes {
					s := &tr.stripes[i]
					n += s.n[segProbation] + s.n[segProtected]
				}
				if n != tr.Len() || n > tr.Capacity() {
					t.Fatalf("seed %d: %d pages listed, Len %d, capacity %d", seed, n, tr.Len(), tr.Capacity())
				}
			}
		}
	}
}
