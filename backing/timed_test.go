package backing

import (
	"sync"
	"testing"
	"time"
)

// timingLog records BackingRead calls.
type timingLog struct {
	mu     sync.Mutex
	tables []uint32
}

func (l *timingLog) FaultServed(table uint32, d time.Duration) {}
func (l *timingLog) BarrierWaited(layer int, d time.Duration)  {}
func (l *timingLog) BackingRead(table uint32, d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.tables = append(l.tables, table)
}

// syncFunc is a SyncReader answering every read at once with zeros.
type syncFunc struct{}

func (syncFunc) Submit(reads ...*TableRead) {
	for _, r := range reads {
		r.Done(make([]byte, r.Len), nil)
	}
}

func (s syncFunc) ReadSync(reads ...*TableRead) { s.Submit(reads...) }

func TestTimedWrapsOnlyWithTimings(t *testing.T) {
	var r Reader = syncFunc{}
	if got := Timed(r, nil); got != r {
		t.Fatalf("Timed with no timings is %T, want the reader itself", got)
	}
	log := &timingLog{}
	timed := Timed(r, log)
	sr, ok := timed.(SyncReader)
	if !ok {
		t.Fatalf("Timed of a SyncReader is %T, not a SyncReader: the fault path would lose its inline reads", timed)
	}
	if _, ok := Timed(ReaderFunc(nil), log).(SyncReader); ok {
		t.Fatal("Timed of a plain Reader claims to be a SyncReader")
	}
	tb := &Table{ID: 7}
	answered := 0
	done := func(data []byte, err error) {
		if err != nil || len(data) != 10 {
			t.Errorf("answer %d bytes, %v", len(data), err)
		}
		answered++
	}
	read := &TableRead{Table: tb, Len: 10, Done: done}
	timed.Submit(read)
	sr.ReadSync(&TableRead{Table: tb, Len: 10, Done: done})
	if answered != 2 || len(log.tables) != 2 || log.tables[0] != 7 || log.tables[1] != 7 {
		t.Fatalf("answered %d, timed %v; want 2 answers, 2 timings of table 7", answered, log.tables)
	}
}
