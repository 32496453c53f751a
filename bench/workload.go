package bench

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"

	"github.com/engramfs/engramfs/backing"
)

// Zipf draws ranks 1..n with P(k) ∝ k^-s for any s > 0, by rejection-inversion
// (Hörmann and Derflinger 1996, as in Apache Commons RNG). math/rand/v2's Zipf
// needs s > 1; decode lookups are s ≈ 0.8-1.0 (docs/design.md, "The hot
// tier"), so we need our own.
// It costs O(1) memory and time per draw whatever n is, unlike an inverse-CDF
// table, which would be 128 MiB for a 16M-row table.
type Zipf struct {
	rng          *rand.Rand
	n, s         float64
	hX1, hN, acc float64
}

// NewZipf returns a sampler of ranks 1..n with exponent s > 0.
func NewZipf(rng *rand.Rand, s float64, n uint64) *Zipf {
	if s <= 0 || n < 1 {
		panic("bench: Zipf needs s > 0 and n >= 1")
	}
	z := &Zipf{rng: rng, n: float64(n), s: s}
	z.hX1 = z.hIntegral(1.5) - 1
	z.hN = z.hIntegral(z.n + 0.5)
	z.acc = 2 - z.hIntegralInverse(z.hIntegral(2.5)-z.h(2))
	return z
}

// Rank draws one rank in 1..n.
func (z *Zipf) Rank() uint64 {
	for {
		u := z.hN + z.rng.Float64()*(z.hX1-z.hN)
		x := z.hIntegralInverse(u)
		k := math.Floor(x + 0.5)
		if k < 1 {
			k = 1
		} else if k > z.n {
			k = z.n
		}
		if k-x <= z.acc || u >= z.hIntegral(k+0.5)-z.h(k) {
			return uint64(k)
		}
	}
}

// h is the (unnormalised) density x^-s; hIntegral its antiderivative
// ((x^(1-s) - 1) / (1-s), log x at s = 1), written so s near 1 stays exact.
func (z *Zipf) h(x float64) float64 { return math.Exp(-z.s * math.Log(x)) }

func (z *Zipf) hIntegral(x float64) float64 {
	lx := math.Log(x)
	return helper2((1-z.s)*lx) * lx
}

func (z *Zipf) hIntegralInverse(x float64) float64 {
	t := x * (1 - z.s)
	if t < -1 {
		t = -1 // rounding only: the exact argument is never below -1
	}
	return math.Exp(helper1(t) * x)
}

// helper1 is log1p(x)/x, helper2 is expm1(x)/x, both continuous at 0.
func helper1(x float64) float64 {
	if math.Abs(x) > 1e-8 {
		return math.Log1p(x) / x
	}
	return 1 - x*(0.5-x*(1.0/3-0.25*x))
}

func helper2(x float64) float64 {
	if math.Abs(x) > 1e-8 {
		return math.Expm1(x) / x
	}
	return 1 + x*0.5*(1+x*(1.0/3)*(1+0.25*x))
}

// Scatter is a bijection of 0..n-1 (x -> (a·x + b) mod n, a coprime to n):
// it places popularity ranks on rows so that popular rows are spread over the
// table, as hashed rows are, instead of packed into its first pages.
type Scatter struct{ a, b, n uint64 }

// NewScatter draws a bijection of 0..n-1.
func NewScatter(rng *rand.Rand, n uint64) Scatter {
	if n <= 1 {
		return Scatter{a: 1, n: max(n, 1)}
	}
	a := n/3 + rng.Uint64N(n/3+1) | 1
	for gcd(a, n) != 1 {
		a++
	}
	return Scatter{a: a % n, b: rng.Uint64N(n), n: n}
}

// Row maps x (0..n-1) to a row.
func (s Scatter) Row(x uint64) uint64 {
	hi, lo := bits.Mul64(s.a, x%s.n)
	lo, c := bits.Add64(lo, s.b, 0)
	return bits.Rem64(hi+c, lo, s.n)
}

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// DecodeSpec shapes the decode workload.
type DecodeSpec struct {
	Steps       int     // decode steps
	RowsPerStep int     // row lookups per layer per step (72)
	S           float64 // Zipf exponent of row popularity (0.9)
}

// DecodeWorkload draws the rows of every decode step: steps[i][j] are the
// RowsPerStep lookups (repeats included, as a real step has them) in layer
// j, whose table has layerRows[j] rows. Each layer has its own popularity
// order.
func DecodeWorkload(seed uint64, layerRows []uint64, spec DecodeSpec) [][][]uint64 {
	rng := rand.New(rand.NewPCG(seed, 0xdec0de))
	type layerDraw struct {
		z  *Zipf
		sc Scatter
	}
	draws := make([]layerDraw, len(layerRows))
	for j, n := range layerRows {
		draws[j] = layerDraw{NewZipf(rng, spec.S, n), NewScatter(rng, n)}
	}
	steps := make([][][]uint64, spec.Steps)
	for i := range steps {
		steps[i] = make([][]uint64, len(layerRows))
		for j, d := range draws {
			rows := make([]uint64, spec.RowsPerStep)
			for k := range rows {
				rows[k] = d.sc.Row(d.z.Rank() - 1)
			}
			steps[i][j] = rows
		}
	}
	return steps
}

// PrefillSpec shapes the prefill workload: chunks of tokens, each token
// looking up one row per n-gram order and hash head in every layer (the
// engram lookup: hash of the token's trailing n-gram, one hash per head).
type PrefillSpec struct {
	Chunks      int     // chunks per run
	ChunkTokens int     // tokens per chunk (8192)
	Orders      []int   // n-gram orders hashed per token ({2, 3})
	Heads       int     // hash heads per order (2)
	Vocab       uint64  // token vocabulary (129280)
	TokenS      float64 // Zipf exponent of token frequency (1.0)
}

// DefaultPrefill is 8192-token chunks, 2- and 3-grams, two heads each: 4
// lookups a token, 20-30K unique rows per layer per chunk on a large
// table, inside the 10K-40K of docs/design.md ("The problem").
func DefaultPrefill(chunks int) PrefillSpec {
	return PrefillSpec{Chunks: chunks, ChunkTokens: 8192, Orders: []int{2, 3}, Heads: 2, Vocab: 129280, TokenS: 1.0}
}

// PrefillWorkload returns chunks[c][j]: the sorted unique rows that chunk c
// needs in layer j, whose table has layerRows[j] rows. Token frequencies
// are Zipf, so common n-grams repeat within a chunk (deduplicated) and
// across chunks (a row the previous chunk already read).
func PrefillWorkload(seed uint64, layerRows []uint64, spec PrefillSpec) [][][]uint64 {
	rng := rand.New(rand.NewPCG(seed, 0x9e3f111))
	tz := NewZipf(rng, spec.TokenS, spec.Vocab)
	tsc := NewScatter(rng, spec.Vocab)
	maxOrder := slices.Max(spec.Orders)
	tokens := make([]uint64, maxOrder-1, maxOrder-1+spec.ChunkTokens)
	for i := range tokens {
		tokens[i] = tsc.Row(tz.Rank() - 1)
	}
	chunks := make([][][]uint64, spec.Chunks)
	for c := range chunks {
		// Keep the last maxOrder-1 tokens: n-grams span chunk boundaries.
		tokens = append(tokens[:0], tokens[len(tokens)-(maxOrder-1):]...)
		for range spec.ChunkTokens {
			tokens = append(tokens, tsc.Row(tz.Rank()-1))
		}
		chunks[c] = make([][]uint64, len(layerRows))
		for j, n := range layerRows {
			rows := make([]uint64, 0, spec.ChunkTokens*len(spec.Orders)*spec.Heads)
			for i := maxOrder - 1; i < len(tokens); i++ {
				for _, ord := range spec.Orders {
					gram := tokens[i-ord+1 : i+1]
					for h := range spec.Heads {
						rows = append(rows, ngramHash(seed, j, ord, h, gram)%n)
					}
				}
			}
			chunks[c][j] = UniqueRows(rows)
		}
	}
	return chunks
}

// ngramHash hashes (layer, order, head, n-gram), the same in every run.
func ngramHash(seed uint64, layer, order, head int, gram []uint64) uint64 {
	x := seed ^ uint64(layer)<<48 ^ uint64(order)<<40 ^ uint64(head)<<32
	for _, t := range gram {
		x = backing.SynthWord(x, t)
	}
	return x
}

// UniqueRows sorts rows and removes repeats, in place.
func UniqueRows(rows []uint64) []uint64 {
	slices.Sort(rows)
	return slices.Compact(rows)
}

// PageCounter counts the file pages that rows of every table of a layer
// need and that no earlier Add counted: in the mount's layout (data
// page-aligned: the 4 KiB reads a cold gather through the mount needs at
// the least) or in the shards' (data wherever the safetensors header left
// it: what a page cache over the shards reads). Chunks share pages (small
// rows pack many to a page; common n-grams recur), so a chunk after the
// first needs fewer reads than it has distinct pages.
type PageCounter struct {
	m      *backing.Model
	shard  bool
	seen   map[pageKey]struct{}
	shards map[*backing.Shard]uint32
}

// pageKey is a page of a file: a table file of the mount (table ID), or a
// shard (its index in Model.Shards).
type pageKey struct {
	table uint32
	page  uint64
}

// NewPageCounter counts pages of m's tables in the mount's layout, none seen yet.
func NewPageCounter(m *backing.Model) *PageCounter {
	return &PageCounter{m: m, seen: map[pageKey]struct{}{}}
}

// NewShardPageCounter counts pages of m's shard files, none seen yet.
func NewShardPageCounter(m *backing.Model) *PageCounter {
	c := &PageCounter{m: m, shard: true, seen: map[pageKey]struct{}{}, shards: map[*backing.Shard]uint32{}}
	for i, sh := range m.Shards {
		c.shards[sh] = uint32(i)
	}
	return c
}

// Add counts the pages rows need in every table of layer and returns how
// many were not seen before.
func (c *PageCounter) Add(layer int, rows []uint64) int {
	fresh, _ := c.AddReads(layer, rows)
	return fresh
}

// AddReads is Add, and also returns the reads those unseen pages take at
// the least: one for each row in each table that needs a page not seen
// before (a row's pages are adjacent, one read; a later row on a page an
// earlier one brought in needs none). No cache, however large, serves
// rows that need an unseen page without these reads.
func (c *PageCounter) AddReads(layer int, rows []uint64) (pages, reads int) {
	for _, t := range c.m.LayerTables(layer) {
		for _, r := range rows {
			file, first, last := c.rowPages(t, r)
			fresh := 0
			for pg := first; pg <= last; pg++ {
				k := pageKey{file, pg}
				if _, ok := c.seen[k]; !ok {
					c.seen[k] = struct{}{}
					fresh++
				}
			}
			if fresh > 0 {
				pages, reads = pages+fresh, reads+1
			}
		}
	}
	return pages, reads
}

func (c *PageCounter) rowPages(t *backing.Table, r uint64) (file uint32, first, last uint64) {
	if !c.shard {
		first, last = t.RowPages(r)
		return t.ID, first, last
	}
	off := uint64(t.DataStart) + r*uint64(t.RowBytes)
	return c.shards[t.Shard], off / backing.PageSize, (off + uint64(t.RowBytes) - 1) / backing.PageSize
}

// Len is the number of distinct pages counted.
func (c *PageCounter) Len() int { return len(c.seen) }

// ReadOnceBytes is what reading every counted page once costs. In the
// shards' layout, a page each. In the mount's, a shard read with offset
// alignment align (O_DIRECT's) of the aligned superset of each run of
// adjacent pages' bytes in the shard, whose table data starts anywhere:
// the least backing bytes a daemon that reads no page twice can ask.
func (c *PageCounter) ReadOnceBytes(align int64) uint64 {
	if c.shard {
		return uint64(len(c.seen)) * backing.PageSize
	}
	align = max(align, 1)
	byTable := map[uint32][]uint64{}
	for k := range c.seen {
		byTable[k.table] = append(byTable[k.table], k.page)
	}
	var total uint64
	for id, pages := range byTable {
		t := c.m.Tables[id]
		slices.Sort(pages)
		for i := 0; i < len(pages); {
			j := i
			for j+1 < len(pages) && pages[j+1] == pages[j]+1 {
				j++
			}
			// The run's bytes in the shard, without header pages (served
			// from memory) and past the table's end.
			lo := max(int64(pages[i])-int64(t.DataPage()), 0) * backing.PageSize
			hi := min((int64(pages[j])+1-int64(t.DataPage()))*backing.PageSize, t.DataLen)
			if hi > lo {
				start := (t.DataStart + lo) / align * align
				end := (t.DataStart + hi + align - 1) / align * align
				total += uint64(end - start)
			}
			i = j + 1
		}
	}
	return total
}
