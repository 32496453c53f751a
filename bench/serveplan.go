package bench

import (
	"fmt"
	"math/rand/v2"
	"slices"
)

// ServeSpec shapes the requests of the serving loop: each a prefill of
// Chunks chunks, then Steps decode steps. Row ids are what n-gram hashes
// give: a Zipf-popular head and a long tail, the same popularity for
// prefill and decode (a common n-gram is common in both), and in every
// chunk RareFraction of its rows from the far tail, rows no other chunk or
// step names.
type ServeSpec struct {
	Requests     int     `json:"requests"`
	Chunks       int     `json:"chunks_per_request"`
	ChunkRows    int     `json:"chunk_rows"`    // unique rows per layer per chunk
	RareFraction float64 `json:"rare_fraction"` // of a chunk's rows: tail rows named nowhere else
	Steps        int     `json:"steps_per_request"`
	StepRows     int     `json:"step_rows"` // row lookups per layer per step (repeats kept)
	S            float64 `json:"zipf_s"`    // Zipf exponent of row popularity
}

// ServeRequest is one request of a rank: its chunks' rows (chunk -> layer
// index -> sorted unique rows) and its steps' lookups (step -> layer index
// -> rows, repeats kept, as a step has them).
type ServeRequest struct {
	Chunks [][][]uint64
	Steps  [][][]uint64
}

// rareRows is how many rows of a chunk's layer are rare.
func (s ServeSpec) rareRows() int { return int(float64(s.ChunkRows)*s.RareFraction + 0.5) }

func (s ServeSpec) check() error {
	switch {
	case s.Requests < 1 || s.Chunks < 1 || s.ChunkRows < 1 || s.Steps < 1 || s.StepRows < 1:
		return fmt.Errorf("serving loop: need at least one request, chunk, chunk row, step and step row")
	case s.RareFraction < 0 || s.RareFraction > 1:
		return fmt.Errorf("serving loop: rare fraction %v: want 0..1", s.RareFraction)
	case s.S <= 0:
		return fmt.Errorf("serving loop: Zipf s must be positive")
	}
	return nil
}

// ServePlan draws rank's requests over layers of layerRows rows: the same
// for a seed, rank and spec in every process (each rank process draws its
// own; the coordinator draws them all to count their pages). Each rank has
// its own rows (its own bijection of popularity ranks to rows, as each
// rank's hash heads are its own), and its own rare rows.
func ServePlan(seed uint64, rank int, layerRows []uint64, spec ServeSpec) ([]ServeRequest, error) {
	if err := spec.check(); err != nil {
		return nil, err
	}
	rare := spec.rareRows()
	reserved := uint64(spec.Requests * spec.Chunks * rare)
	popular := spec.ChunkRows - rare
	reqs := make([]ServeRequest, spec.Requests)
	for i := range reqs {
		reqs[i] = ServeRequest{Chunks: make([][][]uint64, spec.Chunks), Steps: make([][][]uint64, spec.Steps)}
		for k := range reqs[i].Chunks {
			reqs[i].Chunks[k] = make([][]uint64, len(layerRows))
		}
		for s := range reqs[i].Steps {
			reqs[i].Steps[s] = make([][]uint64, len(layerRows))
		}
	}
	for j, n := range layerRows {
		// The far tail, ranks [n-reserved, n), is kept for the rare rows:
		// the Zipf draws ranks below it, so no popular draw names one.
		if reserved > n/2 || uint64(popular) > (n-reserved)/2 {
			return nil, fmt.Errorf("serving loop: layer %d has %d rows, too few for %d rare rows and %d popular rows a chunk (make the tables larger or the plan smaller)",
				j, n, reserved, popular)
		}
		rng := rand.New(rand.NewPCG(seed, uint64(rank)<<32|uint64(j)))
		z := NewZipf(rng, spec.S, n-reserved)
		sc := NewScatter(rng, n)
		nextRare := n - 1
		for i := range reqs {
			for k := range reqs[i].Chunks {
				seen := make(map[uint64]struct{}, spec.ChunkRows)
				rows := make([]uint64, 0, spec.ChunkRows)
				// popular is at most half the ranks drawn from; the cap only
				// stops a Zipf so steep that it keeps drawing the same rows.
				for draws := 0; len(rows) < popular; draws++ {
					if draws > 1000*spec.ChunkRows {
						return nil, fmt.Errorf("serving loop: layer %d: %d draws gave only %d distinct popular rows of %d", j, draws, len(rows), popular)
					}
					r := sc.Row(z.Rank() - 1)
					if _, ok := seen[r]; !ok {
						seen[r] = struct{}{}
						rows = append(rows, r)
					}
				}
				for range rare {
					rows = append(rows, sc.Row(nextRare))
					nextRare--
				}
				slices.Sort(rows)
				reqs[i].Chunks[k][j] = rows
			}
			for s := range reqs[i].Steps {
				rows := make([]uint64, spec.StepRows)
				for x := range rows {
					rows[x] = sc.Row(z.Rank() - 1)
				}
				reqs[i].Steps[s][j] = rows
			}
		}
	}
	return reqs, nil
}

// PlanShape is what a plan's rows look like: how many of a chunk's rows no
// other chunk or step of the rank names, and how many of a step's lookups
// name a row an earlier chunk or step of the rank named.
type PlanShape struct {
	ChunkRows       int     `json:"chunk_rows"`       // unique rows a chunk, all layers (mean)
	ChunkSingletons float64 `json:"chunk_singletons"` // of them, named by no other chunk or step
	StepLookups     int     `json:"step_lookups"`     // lookups a step, all layers
	StepSeenBefore  float64 `json:"step_seen_before"` // of them, of rows named earlier (a cache could hold them)
}

// Shape measures the plan of one rank.
func Shape(reqs []ServeRequest) PlanShape {
	type key struct {
		layer int
		row   uint64
	}
	named := map[key]int{} // by how many chunks and steps
	each := func(f func(layer int, rows []uint64)) {
		for _, rq := range reqs {
			for _, ch := range rq.Chunks {
				for j, rows := range ch {
					f(j, rows)
				}
			}
			for _, st := range rq.Steps {
				for j, rows := range st {
					f(j, UniqueRows(slices.Clone(rows)))
				}
			}
		}
	}
	each(func(j int, rows []uint64) {
		for _, r := range rows {
			named[key{j, r}]++
		}
	})
	var sh PlanShape
	var chunks, chunkRows, singles, steps, lookups, seenBefore int
	seen := map[key]bool{}
	for _, rq := range reqs {
		for _, ch := range rq.Chunks {
			chunks++
			for j, rows := range ch {
				chunkRows += len(rows)
				for _, r := range rows {
					if named[key{j, r}] == 1 {
						singles++
					}
					seen[key{j, r}] = true
				}
			}
		}
		for _, st := range rq.Steps {
			steps++
			for j, rows := range st {
				lookups += len(rows)
				for _, r := range rows {
					if seen[key{j, r}] {
						seenBefore++
					}
				}
				for _, r := range rows {
					seen[key{j, r}] = true
				}
			}
		}
	}
	if chunks > 0 && chunkRows > 0 {
		sh.ChunkRows, sh.ChunkSingletons = chunkRows/chunks, float64(singles)/float64(chunkRows)
	}
	if steps > 0 && lookups > 0 {
		sh.StepLookups, sh.StepSeenBefore = lookups/steps, float64(seenBefore)/float64(lookups)
	}
	return sh
}
