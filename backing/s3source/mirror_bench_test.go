package s3source

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// The mirror-warm decode step against the same step over a local shard:
// 128 reads of 4 KiB at page offsets + 100 (a table's pages start anywhere
// in a shard) of the same bytes on the same disk, through the same engine.
// The target is the mirror within 1.1× of the local shard.
//
//	go test -run '^$' -bench 'Step' -benchtime 2000x ./backing/s3source/

const stepReads = 128

func BenchmarkMirrorStep(b *testing.B) {
	src, st, want := engineMirrorSource(b, testEngine(b, 64), b.TempDir(), 9, 64<<20)
	sf, err := src.Open(mirrorKey)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	defer sf.Close()
	for off := int64(0); off < int64(len(want)); off += 1 << 20 {
		benchStep(b, sf, []int64{off}, min(1<<20, len(want)-int(off)))
	}
	src.mir.sync()
	gets := st.S3Gets.Load()
	runSteps(b, sf, len(want))
	if st.S3Gets.Load() != gets {
		b.Fatalf("%d GETs: the object is not all mirrored", st.S3Gets.Load()-gets)
	}
}

func BenchmarkLocalStep(b *testing.B) {
	eng := testEngine(b, 64)
	dir := b.TempDir()
	want := mirrorObject(nil, 9)
	if err := os.WriteFile(filepath.Join(dir, mirrorKey), want, 0o600); err != nil {
		b.Fatal(err)
	}
	sf, err := backing.NewLocalSource(dir, backing.IOAuto, eng, &stats.Counters{}).Open(mirrorKey)
	if err != nil {
		b.Fatal(err)
	}
	defer sf.Close()
	runSteps(b, sf, len(want))
}

// runSteps times b.N steps of stepReads random page reads.
func runSteps(b *testing.B, sf backing.ShardFile, size int) {
	rng := rand.New(rand.NewPCG(1, 2))
	offs := make([]int64, stepReads)
	b.ResetTimer()
	for range b.N {
		for i := range offs {
			offs[i] = rng.Int64N(int64(size)/4096-1)*4096 + 100
		}
		benchStep(b, sf, offs, 4096)
	}
}

// benchStep reads [off, off+n) for each off, as one Submit, and waits.
func benchStep(b *testing.B, sf backing.ShardFile, offs []int64, n int) {
	var wg sync.WaitGroup
	wg.Add(len(offs))
	reads := make([]*backing.ShardRead, len(offs))
	for i, off := range offs {
		reads[i] = &backing.ShardRead{Off: off, Len: n, Done: func(_ []byte, err error) {
			if err != nil {
				b.Error(err)
			}
			wg.Done()
		}}
	}
	sf.Submit(reads...)
	wg.Wait()
}
