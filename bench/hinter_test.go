package bench

import (
	"testing"

	"github.com/engramfs/engramfs/hints"
)

func TestParseBarrier(t *testing.T) {
	r, err := parseBarrier([]byte(`{"frames":2,"pages":150,"resident":140,"pinned":30,"dropped":0,"failed":10}` + "\n"))
	if err != nil || r != (hints.Status{Frames: 2, Pages: 150, Resident: 140, Pinned: 30, Failed: 10}) {
		t.Errorf("parsed %+v, %v", r, err)
	}
	for _, bad := range []string{"", "ok\n", "{}\n{}\n"} {
		if _, err := parseBarrier([]byte(bad)); err == nil {
			t.Errorf("%q parsed as a barrier reply", bad)
		}
	}
}
