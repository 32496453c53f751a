package s3serve

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A process that faults pages of an engramfs mount must not serve the
// GETs those faults wait for: a thread in a page fault cannot be preempted,
// so a garbage collection's stop-the-world waits for the fault, while the
// fault waits for a proxy goroutine the stop-the-world has stopped (seen:
// a cold fault stalled 4 × 30 s, then failed with SIGBUS). So the bench runs
// its latency proxy in a child: the executable itself, re-run with
// proxyEnv set, which this package's init turns into the proxy.
const proxyEnv = "ENGRAMFS_S3SERVE_LATENCY_PROXY"

// statsPath is the proxy's own endpoint: its counts as JSON. No S3 request
// has it (a bucket name has no underscores).
const statsPath = "/__latency_proxy_stats"

func init() {
	if spec := os.Getenv(proxyEnv); spec != "" {
		os.Exit(proxyChild(spec))
	}
}

// proxyChild serves the proxy that spec (see encodeSpec) describes, prints
// its URL on stdout, and serves until stdin closes (the parent is gone or
// done).
func proxyChild(spec string) int {
	endpoint, lat, err := decodeSpec(spec)
	if err != nil {
		fmt.Fprintln(os.Stderr, "latency proxy:", err)
		return 2
	}
	p, err := NewLatencyProxy(endpoint, lat)
	if err != nil {
		fmt.Fprintln(os.Stderr, "latency proxy:", err)
		return 1
	}
	fmt.Println(p.URL)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // EOF when the parent closes it
	_ = p.Close()
	return 0
}

func encodeSpec(endpoint string, lat Latency) string {
	return strings.Join([]string{endpoint, lat.FirstByte.String(), lat.SlowFirstByte.String(),
		strconv.FormatFloat(lat.SlowFraction, 'g', -1, 64), strconv.FormatUint(lat.Seed, 10)}, " ")
}

func decodeSpec(spec string) (string, Latency, error) {
	f := strings.Fields(spec)
	if len(f) != 5 {
		return "", Latency{}, fmt.Errorf("spec %q: want 5 fields", spec)
	}
	var lat Latency
	var err [4]error
	lat.FirstByte, err[0] = time.ParseDuration(f[1])
	lat.SlowFirstByte, err[1] = time.ParseDuration(f[2])
	lat.SlowFraction, err[2] = strconv.ParseFloat(f[3], 64)
	lat.Seed, err[3] = strconv.ParseUint(f[4], 10, 64)
	for _, e := range err {
		if e != nil {
			return "", Latency{}, fmt.Errorf("spec %q: %w", spec, e)
		}
	}
	return f[0], lat, nil
}

// ProxyProcess is a LatencyProxy in a child process.
type ProxyProcess struct {
	URL   string
	cmd   *exec.Cmd
	stdin interface{ Close() error }
}

// StartLatencyProxy runs a LatencyProxy to endpoint in a child process
// (this executable, re-run), for a process that faults pages of a mount
// whose GETs go through the proxy. Close stops it.
func StartLatencyProxy(endpoint string, lat Latency) (*ProxyProcess, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), proxyEnv+"="+encodeSpec(endpoint, lat))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("latency proxy: %w", err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "http://") {
		stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("latency proxy: the child said %q (%v)", line, err)
	}
	return &ProxyProcess{URL: strings.TrimSpace(line), cmd: cmd, stdin: stdin}, nil
}

// Responses counts the responses the proxy delayed so far, and of them
// the slow ones.
func (p *ProxyProcess) Responses() (all, slow uint64, err error) {
	resp, err := http.Get(p.URL + statsPath)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	var c proxyCounts
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		return 0, 0, fmt.Errorf("latency proxy stats: %w", err)
	}
	return c.Responses, c.Slow, nil
}

type proxyCounts struct {
	Responses uint64 `json:"responses"`
	Slow      uint64 `json:"slow"`
}

// Close stops the child and waits for it.
func (p *ProxyProcess) Close() error {
	p.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		return fmt.Errorf("latency proxy did not exit within %v; killed it: %v", stopTimeout, <-done)
	}
}
