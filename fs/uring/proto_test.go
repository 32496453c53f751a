package uring

import (
	"testing"
	"unsafe"
)

func TestParseCPUList(t *testing.T) {
	for in, want := range map[string]int{"0": 1, "0-1": 2, "0-3,8": 5, "0,2,4-7": 6} {
		if got, err := parseCPUList(in); err != nil || got != want {
			t.Errorf("parseCPUList(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "a", "3-1", "0-x"} {
		if _, err := parseCPUList(bad); err == nil {
			t.Errorf("parseCPUList(%q): no error", bad)
		}
	}
}

func TestParseMode(t *testing.T) {
	for _, m := range []string{"auto", "uring", "dev"} {
		if got, err := ParseMode(m); err != nil || string(got) != m {
			t.Errorf("ParseMode(%q) = %q, %v", m, got, err)
		}
	}
	if _, err := ParseMode("io_uring"); err == nil {
		t.Error("ParseMode(io_uring): no error")
	}
}

// The rings parse requests with the mount's own go-fuse request state
// (protocolServer); this is the layout that cast relies on.
func TestGoFuseLayout(t *testing.T) {
	if err := checkLayout(); err != nil {
		t.Fatal(err)
	}
}

// The offsets of struct fuse_uring_req_header (include/uapi/linux/fuse.h).
func TestHeaderLayout(t *testing.T) {
	type entInOut struct {
		flags, commitID    uint64
		payloadSz, padding uint32
		reserved           uint64
	}
	type reqHeader struct {
		inOut   [128]byte
		opIn    [128]byte
		ringEnt entInOut
	}
	var h reqHeader
	if unsafe.Sizeof(h) != hdrSize || unsafe.Offsetof(h.opIn) != hdrOpIn ||
		unsafe.Offsetof(h.ringEnt)+unsafe.Offsetof(h.ringEnt.commitID) != hdrCommitID ||
		unsafe.Offsetof(h.ringEnt)+unsafe.Offsetof(h.ringEnt.payloadSz) != hdrPayload {
		t.Fatal("fuse_uring_req_header offsets do not match the constants")
	}
	var s sqe128
	if unsafe.Offsetof(s.cmd) != 48 {
		t.Fatalf("the URING_CMD command area at %d, want 48", unsafe.Offsetof(s.cmd))
	}
}
