package cache

import (
	"testing"
	"time"
)

// testDeadline bounds every wait of a cache test on the loader, the hot
// tier's worker or the pinner: a broken singleflight or worker fails the
// test instead of hanging it until go test's own timeout (with singleflight
// broken, TestLoaderBadPageFailsOnlyItself waited forever).
const testDeadline = 30 * time.Second

// within runs wait and fails t (call it from the test's goroutine) when it
// has not returned within testDeadline.
func within(t testing.TB, what string, wait func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		wait()
	}()
	select {
	case <-done:
	case <-time.After(testDeadline):
		t.Fatalf("%s: still waiting after %v", what, testDeadline)
	}
}

// flush is HotCache.Flush within testDeadline.
func flush(t testing.TB, h *HotCache) {
	t.Helper()
	within(t, "the hot tier's Flush", h.Flush)
}

// load is Loader.Load within testDeadline.
func load(t testing.TB, l *Loader, table uint32, first, n uint64, o Origin) (pages [][]byte, err error) {
	t.Helper()
	within(t, "Loader.Load", func() { pages, err = l.Load(table, first, n, o) })
	return pages, err
}
