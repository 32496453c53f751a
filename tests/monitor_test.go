package tests

import (
	"os"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/sysmon"
)

// TestDaemonQuietsItsMonitor: the daemon gives its runtime monitor thread
// the --monitor-slack timer slack (1 ms by default), and leaves it alone
// with --monitor-slack=0.
func TestDaemonQuietsItsMonitor(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("another thread's timer slack needs CAP_SYS_NICE")
	}
	spec := backing.DefaultSynth()
	spec.Rows = 512
	model := Synth(t, spec)
	for _, c := range []struct {
		args []string
		want time.Duration // 0: not the default's
	}{
		{nil, time.Millisecond},
		{[]string{"--monitor-slack=250us"}, 250 * time.Microsecond},
		{[]string{"--monitor-slack=0"}, 0},
	} {
		d := Mount(t, model, c.args...)
		pid := d.Stats(t).Pid
		tid, err := sysmon.ThreadOf(pid)
		if err != nil {
			t.Fatal(err)
		}
		got, err := sysmon.Slack(tid)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case c.want != 0 && got != c.want:
			t.Errorf("%q: the daemon's monitor thread %d has a timer slack of %v, want %v", c.args, tid, got, c.want)
		case c.want == 0 && got == time.Millisecond:
			t.Errorf("%q: the daemon's monitor thread %d has the default's slack, 1ms", c.args, tid)
		}
		d.Stop(t)
	}
}
