package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"time"
)

// FioFloor is what fio spends on a 4 KiB random read of a shard (io_uring,
// QD64, O_DIRECT): the floor of the CPU a read costs on this machine, against
// which the daemon's CPU per backing page is judged.
type FioFloor struct {
	// Missing says why fio did not run (not on PATH, not asked for, or
	// failed); every figure below is then 0 (n/a).
	Missing string   `json:"missing,omitempty"`
	Command []string `json:"command,omitempty"`
	File    string   `json:"file,omitempty"`

	Version    string  `json:"fio_version,omitempty"`
	RuntimeSec float64 `json:"runtime_seconds,omitempty"` // job_runtime
	Reads      uint64  `json:"reads,omitempty"`           // read.total_ios
	IOPS       float64 `json:"iops,omitempty"`            // read.iops
	UsrCPU     float64 `json:"usr_cpu_percent,omitempty"` // of one CPU, over the runtime
	SysCPU     float64 `json:"sys_cpu_percent,omitempty"`
	// CPUPerRead is (usr_cpu + sys_cpu)/100 × runtime / reads, in µs.
	CPUPerRead float64 `json:"cpu_us_per_read,omitempty"`
}

// fioQueueDepth is the queue depth of the fio floor (the daemon's default).
const fioQueueDepth = 64

// fioArgs is the fio command line for the floor on file.
func fioArgs(file string, runtime time.Duration) []string {
	secs := max(1, int(runtime.Round(time.Second)/time.Second))
	return []string{"--name=floor", "--filename=" + file, "--rw=randread", "--bs=4k", "--direct=1",
		"--ioengine=io_uring", "--iodepth=" + strconv.Itoa(fioQueueDepth), "--runtime=" + strconv.Itoa(secs),
		"--time_based", "--output-format=json"}
}

// MeasureFio runs fio's 4 KiB random-read job on file for runtime (whole
// seconds, at least 1). fio absent or failing is not an error of the run:
// the result says why (Missing) and its figures are n/a.
func MeasureFio(ctx context.Context, file string, runtime time.Duration) *FioFloor {
	if runtime <= 0 {
		return &FioFloor{Missing: "not asked for"}
	}
	bin, err := exec.LookPath("fio")
	if err != nil {
		return &FioFloor{Missing: "fio is not on PATH"}
	}
	args := fioArgs(file, runtime)
	f := &FioFloor{Command: append([]string{bin}, args...), File: file}
	cmd := exec.CommandContext(ctx, bin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		f.Missing = fmt.Sprintf("fio failed: %v: %s", err, bytes.TrimSpace(stderr.Bytes()))
		return f
	}
	parsed, err := parseFio(out)
	if err != nil {
		f.Missing = fmt.Sprintf("fio's output: %v", err)
		return f
	}
	parsed.Command, parsed.File = f.Command, file
	return parsed
}

// parseFio reads fio's --output-format=json for the one job of the floor.
// fio may print notes before the JSON: it starts at the first '{'.
func parseFio(out []byte) (*FioFloor, error) {
	i := bytes.IndexByte(out, '{')
	if i < 0 {
		return nil, errors.New("no JSON")
	}
	var doc struct {
		Version string `json:"fio version"`
		Jobs    []struct {
			Error      int     `json:"error"`
			JobRuntime float64 `json:"job_runtime"` // ms
			UsrCPU     float64 `json:"usr_cpu"`     // %
			SysCPU     float64 `json:"sys_cpu"`
			Read       struct {
				IOPS     float64 `json:"iops"`
				Runtime  float64 `json:"runtime"` // ms
				TotalIOs uint64  `json:"total_ios"`
			} `json:"read"`
		} `json:"jobs"`
	}
	if err := json.NewDecoder(bytes.NewReader(out[i:])).Decode(&doc); err != nil {
		return nil, err
	}
	if len(doc.Jobs) != 1 {
		return nil, fmt.Errorf("%d jobs, want 1", len(doc.Jobs))
	}
	j := doc.Jobs[0]
	if j.Error != 0 {
		return nil, fmt.Errorf("the job failed with error %d", j.Error)
	}
	runtimeMs := j.JobRuntime
	if runtimeMs <= 0 {
		runtimeMs = j.Read.Runtime
	}
	if runtimeMs <= 0 || j.Read.TotalIOs == 0 {
		return nil, fmt.Errorf("no reads (runtime %v ms, %d reads)", runtimeMs, j.Read.TotalIOs)
	}
	f := &FioFloor{
		Version: doc.Version, RuntimeSec: runtimeMs / 1e3, Reads: j.Read.TotalIOs, IOPS: j.Read.IOPS,
		UsrCPU: j.UsrCPU, SysCPU: j.SysCPU,
	}
	f.CPUPerRead = (j.UsrCPU + j.SysCPU) / 100 * f.RuntimeSec / float64(f.Reads) * 1e6
	return f, nil
}

// largestFile is the largest of files (the shard fio reads: the most
// distinct blocks to pick from).
func largestFile(files []string) string {
	best, size := "", int64(-1)
	for _, p := range files {
		if st, err := os.Stat(p); err == nil && st.Size() > size {
			best, size = p, st.Size()
		}
	}
	return best
}
