// Package uring serves a FUSE mount's requests from io_uring queues, one per
// possible CPU (FUSE-over-io_uring, Linux 6.14+, behind the fuse module's
// enable_uring parameter), beside go-fuse's /dev/fuse server, which keeps
// the mount, INIT, the daemon's notifications (NOTIFY_STORE), FORGET and
// INTERRUPT: the kernel sends those through /dev/fuse whatever the
// transport.
//
// A Transport is handed to fs.Server, which calls Prepare before mounting
// (the rings are made, and FUSE_OVER_IO_URING is asked for in INIT only if
// they were), Start once INIT is answered (every queue registers; the
// kernel serves nothing until all have), and Stop after unmounting. Where
// the rings cannot be had, mode auto leaves the mount on /dev/fuse and says
// why, once, in the log and in the fuse_transport stat; mode uring fails
// the mount instead. Nothing waits without a deadline: a queue that does
// not register in time is given up, and a REGISTER that fails makes the
// kernel serve /dev/fuse instead, before the mount is reported up.
package uring

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"go.uber.org/zap"

	"github.com/engramfs/engramfs/internal/stats"
)

// Mode is what --fuse-transport asks for.
type Mode string

const (
	// Auto serves from the rings where the kernel offers them and every
	// queue registers, else from /dev/fuse.
	Auto Mode = "auto"
	// Rings requires the rings: the mount fails without them.
	Rings Mode = "uring"
	// Dev serves from /dev/fuse only.
	Dev Mode = "dev"
)

// ParseMode checks a --fuse-transport value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case Auto, Rings, Dev:
		return m, nil
	}
	return "", fmt.Errorf("unknown FUSE transport %q (want auto, uring or dev)", s)
}

const (
	// maxDepth entries a queue: requests past them wait in the kernel for
	// an entry of their CPU's queue. A reader's WILLNEED burst (the
	// engine's v3 path) puts a decode step's 72 rows on its CPU's queue at
	// once, as background READs; with 16 entries a v3 step took 1.48x its
	// time on /dev/fuse (go-fuse starts a reader per request), the loader
	// no longer saw enough reads at once to batch them.
	maxDepth = 64
	minDepth = 2
	// maxEntries bounds the entries, and so the threads, of all queues
	// together: on a machine with many possible CPUs the depth shrinks.
	maxEntries = 512
	// deadline bounds each phase (making the rings, registering them): an
	// entry whose thread has not answered by then is given up, and the
	// mount falls back (auto) or fails (uring) instead of hanging.
	deadline = 10 * time.Second
)

// Transport is the rings of one mount.
type Transport struct {
	mode Mode
	log  *zap.Logger
	st   *stats.Counters

	payload int // bytes of each entry's payload buffer
	fd      int // /dev/fuse, once Start knows it
	depth   int // entries (and threads) a queue
	entries []*entry

	once  sync.Once // the fallback is logged once
	state atomic.Pointer[string]

	requests, enters atomic.Uint64
}

// New returns the transport of one mount; st (may be nil) hears which
// transport serves it, as fuse_transport.
func New(mode Mode, st *stats.Counters, log *zap.Logger) *Transport {
	if log == nil {
		log = zap.NewNop()
	}
	t := &Transport{mode: mode, st: st, log: log, fd: -1}
	t.set(string(Dev))
	return t
}

// State is what serves the mount: "uring", "dev", or "dev: <why the rings
// are not used>".
func (t *Transport) State() string { return *t.state.Load() }

func (t *Transport) set(s string) {
	t.state.Store(&s)
	if t.st != nil {
		t.st.SetFuseTransport(s)
	}
}

// Serving reports whether the rings serve the mount.
func (t *Transport) Serving() bool { return t.State() == string(Rings) }

// giveUp records why the rings are not used: an error in mode uring, a
// logged fallback in mode auto.
func (t *Transport) giveUp(why error) error {
	t.stopQueues()
	t.set("dev: " + why.Error())
	if t.mode == Rings {
		return fmt.Errorf("--fuse-transport uring: %w", why)
	}
	if errors.Is(why, errStuck) {
		// The kernel waits for rings that will never be ready: every
		// request would hang. Only unmounting ends that.
		return why
	}
	t.once.Do(func() {
		t.log.Info("FUSE requests served from /dev/fuse, not io_uring", zap.String("why", why.Error()))
	})
	return nil
}

// Prepare makes the rings before mounting and, if every queue has one,
// asks for FUSE_OVER_IO_URING in opts. It fails only in mode uring.
func (t *Transport) Prepare(opts *fuse.MountOptions) error {
	if t.mode == Dev {
		return nil
	}
	if err := checkLayout(); err != nil {
		return t.giveUp(err)
	}
	on, err := enabled()
	if err != nil {
		return t.giveUp(err)
	}
	if !on {
		return t.giveUp(errors.New("the fuse module's enable_uring is off (" + enableUringSys + ")"))
	}
	n, err := numPossibleCPUs()
	if err != nil {
		return t.giveUp(err)
	}
	maxWrite := opts.MaxWrite
	if maxWrite <= 0 {
		maxWrite = 128 << 10 // go-fuse's default
	}
	page := 4096
	t.payload = max(minPayload, (maxWrite+page-1)/page*page)
	t.depth = min(maxDepth, max(minDepth, maxEntries/n))
	for qid := range n {
		for range t.depth {
			e := newEntry(t, qid)
			t.entries = append(t.entries, e)
			go e.run()
		}
	}
	timeout := time.After(deadline)
	for _, e := range t.entries {
		select {
		case err := <-e.setupErr:
			if err != nil {
				return t.giveUp(fmt.Errorf("queue %d: %w", e.qid, err))
			}
		case <-timeout:
			return t.giveUp(fmt.Errorf("queue %d: no ring after %v", e.qid, deadline))
		}
	}
	opts.ExtraCapabilities |= fuse.CAP_OVER_IO_URING
	return nil
}

// Start registers every queue once srv has answered INIT, before srv's
// mount is used. If the kernel did not take FUSE_OVER_IO_URING, or a queue
// does not register, the mount stays on (or falls back to) /dev/fuse. It
// fails only in mode uring; the caller then unmounts.
func (t *Transport) Start(srv *fuse.Server) error {
	if len(t.entries) == 0 {
		return nil // Prepare gave up, or mode dev
	}
	if srv.KernelSettings().Flags64()&fuse.CAP_OVER_IO_URING == 0 {
		return t.giveUp(errors.New("the kernel did not offer FUSE_OVER_IO_URING in INIT"))
	}
	fd, err := fuseFD(srv)
	if err != nil {
		return t.giveUp(t.fallback(err))
	}
	t.fd = fd
	ps := protocolServer(srv)
	for _, e := range t.entries {
		e.start <- ps
	}
	timeout := time.After(deadline)
	for _, e := range t.entries {
		select {
		case err := <-e.regErr:
			if err != nil {
				// The kernel fell back itself when a REGISTER failed; an
				// entry that failed before it reached the kernel needs
				// the fallback forced.
				return t.giveUp(t.fallback(err))
			}
		case <-timeout:
			if e.state.CompareAndSwap(statePending, stateAbandoned) {
				return t.giveUp(t.fallback(fmt.Errorf("queue %d: not registered after %v", e.qid, deadline)))
			}
			// It is registering now: its answer is a system call away.
			if err := <-e.regErr; err != nil {
				return t.giveUp(t.fallback(err))
			}
		}
	}
	t.set(string(Rings))
	t.log.Info("FUSE requests served from io_uring", zap.Int("queues", len(t.entries)/t.depth), zap.Int("depth", t.depth))
	return nil
}

// fallback makes sure the kernel has given the rings up (see forceFallback)
// and returns why.
func (t *Transport) fallback(why error) error {
	// Entries still pending must not register after this.
	for _, e := range t.entries {
		e.state.CompareAndSwap(statePending, stateAbandoned)
	}
	if t.fd >= 0 {
		if err := forceFallback(t.fd); err != nil {
			return fmt.Errorf("%w: %v; and the fallback to /dev/fuse failed: %v", errStuck, why, err)
		}
	}
	return why
}

// errStuck is a fallback that did not happen: the mount must go.
var errStuck = errors.New("FUSE over io_uring negotiated but not served")

// stopQueues ends the threads of entries that never registered (before or
// instead of serving): they close their rings and exit. Entries parked
// before a fallback stay parked, unused, until the unmount ends them.
func (t *Transport) stopQueues() {
	for _, e := range t.entries {
		select {
		case e.start <- nil:
		default:
		}
	}
	t.entries = nil
}

// Stop ends the threads of entries that serve nothing. Serving entries end
// by themselves once the mount is gone (the kernel ends every parked entry
// at unmount; a mount detached lazily is served until its last reader
// lets go, or the daemon exits); Stop does not wait for them.
func (t *Transport) Stop() {
	if !t.Serving() {
		t.stopQueues()
		return
	}
	st := t.Stats()
	t.log.Info("fuse rings stopping", zap.Uint64("requests", st.Requests), zap.Uint64("enters", st.Enters))
}

// Stats are the transport's own counters.
type Stats struct {
	Requests uint64 // requests served from the rings
	Enters   uint64 // io_uring_enter calls of the entries' threads
}

// Stats returns the transport's counters.
func (t *Transport) Stats() Stats {
	return Stats{t.requests.Load(), t.enters.Load()}
}
