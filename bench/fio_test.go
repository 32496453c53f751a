package bench

import (
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
)

// testdata/fio-randread-io_uring-qd64.json is the output of fio 3.33 on this
// kind of VM running the floor's job (fioArgs) with --runtime=2 on a 64 MiB
// file, trimmed to the job's summary fields.
func TestParseFio(t *testing.T) {
	raw, err := os.ReadFile("testdata/fio-randread-io_uring-qd64.json")
	if err != nil {
		t.Fatal(err)
	}
	// fio prints notes before its JSON at times: they are skipped.
	for _, out := range [][]byte{raw, append([]byte("note: both iodepth >= 1 and synchronous I/O engine are selected\n"), raw...)} {
		f, err := parseFio(out)
		if err != nil {
			t.Fatal(err)
		}
		if f.Version != "fio-3.33" || f.Reads != 108569 || !near(f.IOPS, 54257.371314) || !near(f.RuntimeSec, 2) || f.UsrCPU != 4.7 || f.SysCPU != 45.15 {
			t.Errorf("parsed %+v", f)
		}
		// (4.7% + 45.15%) of 2 s = 0.997 s over 108569 reads.
		if want := 0.997 / 108569 * 1e6; !near(f.CPUPerRead, want) {
			t.Errorf("CPU a read = %v µs, want %v", f.CPUPerRead, want)
		}
	}
	for name, bad := range map[string]string{
		"no JSON":   "fio: pid=1, err=2/file:filesetup.c:1, func=open, error=No such file or directory\n",
		"job error": strings.Replace(string(raw), `"error": 0`, `"error": 5`, 1),
		"no reads":  strings.Replace(string(raw), `"total_ios": 108569`, `"total_ios": 0`, 1),
		"no jobs":   `{"fio version": "fio-3.33", "jobs": []}`,
	} {
		if f, err := parseFio([]byte(bad)); err == nil {
			t.Errorf("%s: parsed %+v", name, f)
		}
	}
}

func TestFioArgs(t *testing.T) {
	want := strings.Fields("--name=floor --filename=/m/s --rw=randread --bs=4k --direct=1 --ioengine=io_uring --iodepth=64 --runtime=5 --time_based --output-format=json")
	if got := fioArgs("/m/s", 5*time.Second); !reflect.DeepEqual(got, want) {
		t.Errorf("fio %v\nwant %v", got, want)
	}
}

// TestMeasureFioMissing: without fio (or not asked for), the floor says why
// and has no figures; the run goes on.
func TestMeasureFioMissing(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	f := MeasureFio(t.Context(), "/nonexistent", time.Second)
	if f.Missing != "fio is not on PATH" || f.CPUPerRead != 0 {
		t.Errorf("no fio: %+v", f)
	}
	if f := MeasureFio(t.Context(), "/nonexistent", 0); f.Missing != "not asked for" {
		t.Errorf("runtime 0: %+v", f)
	}
}
