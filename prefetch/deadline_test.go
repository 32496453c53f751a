package prefetch

import (
	"context"
	"testing"
	"time"
)

// testDeadline bounds every barrier wait of a prefetch test: a broken
// scheduler or pusher fails the test with context.DeadlineExceeded instead
// of hanging it (t.Context() ends only once the test has returned).
const testDeadline = 30 * time.Second

// waitCtx is the context of a test's barrier waits: done after testDeadline.
func waitCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), testDeadline)
	t.Cleanup(cancel)
	return ctx
}
