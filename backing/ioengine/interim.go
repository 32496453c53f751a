// Package ioengine: interim pread pool with the engine API, replaced by the
// io_uring engine (branch engine) at merge.
package ioengine

import (
	"errors"
	"sync"

	"golang.org/x/sys/unix"
)

type Req struct {
	Fd   int
	Off  int64
	Buf  []byte
	Done func(n int, err error)
}

var ErrClosed = errors.New("read engine closed")

type Engine interface {
	Submit(reqs ...*Req)
	Name() string
	Close() error
}

func New(kind string, queueDepth int) (Engine, string, error) {
	e := &pool{work: make(chan *Req, 1<<16)}
	for range queueDepth {
		e.wg.Add(1)
		go e.worker()
	}
	return e, "interim", nil
}

type pool struct {
	mu     sync.RWMutex
	closed bool
	work   chan *Req
	wg     sync.WaitGroup
}

func (p *pool) Name() string { return "pread" }
func (p *pool) Submit(reqs ...*Req) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, r := range reqs {
		if p.closed {
			r.Done(0, ErrClosed)
			continue
		}
		p.work <- r
	}
}
func (p *pool) worker() {
	defer p.wg.Done()
	for r := range p.work {
		done := 0
		var err error
		for done < len(r.Buf) {
			n, e := unix.Pread(r.Fd, r.Buf[done:], r.Off+int64(done))
			if e == unix.EINTR {
				continue
			}
			if e != nil {
				err = e
				break
			}
			if n == 0 {
				break
			}
			done += n
		}
		r.Done(done, err)
	}
}
func (p *pool) Close() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.work)
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}
