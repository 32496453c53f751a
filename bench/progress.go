package bench

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// progress is the live status line on stderr. On a terminal it is one line
// rewritten in place (carriage return, at most 10 times a second); on
// anything else each new phase gets a plain line and updates are dropped,
// so a log file stays readable.
type progress struct {
	w   io.Writer
	tty bool

	mu    sync.Mutex
	phase string    // GUARDED_BY(mu)
	last  time.Time // GUARDED_BY(mu)
	shown bool      // GUARDED_BY(mu): a line is on screen, not ended
	start time.Time
	width int // GUARDED_BY(mu): of the line on screen
}

func newProgress(w io.Writer, tty bool) *progress {
	return &progress{w: w, tty: tty, start: time.Now()}
}

// setPhase starts a new phase (shown at once).
func (p *progress) setPhase(format string, a ...any) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.phase = fmt.Sprintf(format, a...)
	if !p.tty {
		fmt.Fprintf(p.w, "[%s] %s\n", p.elapsed(), p.phase)
		return
	}
	p.draw(p.phase)
}

// update shows detail after the phase, rate-limited.
func (p *progress) update(format string, a ...any) {
	if p == nil || p.w == nil || !p.tty {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < 100*time.Millisecond {
		return
	}
	p.draw(p.phase + ": " + fmt.Sprintf(format, a...))
}

// printf prints a line that stays (a note), above the progress line.
func (p *progress) printf(format string, a ...any) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clear()
	fmt.Fprintf(p.w, format+"\n", a...)
	if p.tty && p.phase != "" {
		p.draw(p.phase)
	}
}

// done erases the progress line.
func (p *progress) done() {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clear()
	p.phase = ""
}

// REQUIRES(p.mu)
func (p *progress) draw(s string) {
	line := fmt.Sprintf("[%s] %s", p.elapsed(), s)
	pad := ""
	if n := p.width - len(line); n > 0 {
		pad = strings.Repeat(" ", n)
	}
	fmt.Fprintf(p.w, "\r%s%s\r%s", line, pad, line)
	p.width = len(line)
	p.shown = true
	p.last = time.Now()
}

// REQUIRES(p.mu)
func (p *progress) clear() {
	if p.tty && p.shown {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", p.width))
		p.shown, p.width = false, 0
	}
}

func (p *progress) elapsed() string {
	d := time.Since(p.start).Round(time.Second)
	return fmt.Sprintf("%d:%02d", int(d.Minutes()), int(d.Seconds())%60)
}
