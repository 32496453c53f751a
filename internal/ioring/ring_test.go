package ioring

import (
	"errors"
	"runtime"
	"syscall"
	"testing"
)

// nop is a 64-byte SQE; opcode 0 is IORING_OP_NOP.
type nop struct {
	opcode   uint8
	_        [31]byte
	userData uint64
	_        [24]byte
}

// big is a 128-byte SQE, for a ring set up with SetupSQE128.
type big struct {
	opcode   uint8
	_        [31]byte
	userData uint64
	_        [88]byte
}

func TestNopsComplete(t *testing.T) {
	runtime.LockOSThread() // the second flag set is single-issuer
	defer runtime.UnlockOSThread()
	for name, run := range map[string]func(t *testing.T){
		"64-byte SQEs": func(t *testing.T) { roundTrip[nop](t, []uint32{SetupClamp}, func(s *nop, u uint64) { s.userData = u }) },
		"128-byte SQEs": func(t *testing.T) {
			roundTrip[big](t, []uint32{SetupSQE128 | SetupSingleIssuer | SetupDeferTaskrun, SetupSQE128}, func(s *big, u uint64) { s.userData = u })
		},
	} {
		t.Run(name, run)
	}
}

func roundTrip[S any](t *testing.T, flags []uint32, set func(*S, uint64)) {
	r, err := New[S](4, flags)
	if errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.EPERM) {
		t.Skipf("no io_uring here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Space() != r.SQEntries || r.SQEntries < 4 {
		t.Fatalf("space %d of %d entries", r.Space(), r.SQEntries)
	}
	for i := range 3 {
		set(r.Next(), uint64(100+i))
		r.Publish()
	}
	if r.Unsubmitted() != 3 {
		t.Fatalf("%d unsubmitted, want 3", r.Unsubmitted())
	}
	if _, err := r.Enter(3, 3, EnterGetEvents); err != nil {
		t.Fatal(err)
	}
	c := r.Reap(nil)
	if len(c) != 3 || r.Unsubmitted() != 0 {
		t.Fatalf("completions %+v, %d unsubmitted", c, r.Unsubmitted())
	}
	for i, e := range c {
		if e.UserData != uint64(100+i) || e.Res != 0 {
			t.Errorf("completion %d: %+v", i, e)
		}
	}
	if len(r.Reap(nil)) != 0 {
		t.Error("completions reaped twice")
	}
}

func TestRefusesOtherSQESizes(t *testing.T) {
	if _, err := New[[32]byte](4, []uint32{0}); err == nil {
		t.Fatal("a 32-byte SQE type was accepted")
	}
}
