// Package s3serve runs a real S3 server on this machine: versitygw with its
// posix backend on 127.0.0.1, stopped by PID. The bench's object-store run
// uses it directly; tests use it through s3test, which skips or fails a
// test when versitygw is missing.
//
// Install versitygw with
//
//	go install github.com/versity/versitygw/cmd/versitygw@v1.8.0
package s3serve

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// Credentials of the server's root user (loopback only).
const (
	AccessKey = "engramfs-test-access"
	SecretKey = "engramfs-test-secret-key"
	Region    = "us-east-1"
)

// ErrNoBinary is Binary's error when versitygw is not installed.
var ErrNoBinary = errors.New("versitygw not found in $PATH or $(go env GOPATH)/bin: go install github.com/versity/versitygw/cmd/versitygw@v1.8.0")

// Binary finds versitygw in $PATH or $(go env GOPATH)/bin.
func Binary() (string, error) {
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	gopath := os.Getenv("GOPATH")
	if gopath == "" {
		if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
			gopath = strings.TrimSpace(string(out))
		}
	}
	if gopath == "" {
		if home, err := os.UserHomeDir(); err == nil {
			gopath = filepath.Join(home, "go") // go's default, for a machine without go on PATH
		}
	}
	for _, dir := range filepath.SplitList(gopath) {
		p := filepath.Join(dir, "bin", "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", ErrNoBinary
}

// Server is a running versitygw.
type Server struct {
	Endpoint string // http://127.0.0.1:PORT
	Root     string // the posix backend's directory: buckets are its subdirectories
	// Client is an SDK client of the server, for setup (buckets, uploads,
	// rewrites): not the client under test.
	Client *s3.Client

	cmd    *exec.Cmd
	exited chan error
}

// How long versitygw may take to answer after its start (generous: builds
// and benchmarks share the machine), and to exit after SIGINT.
const (
	startTimeout = 30 * time.Second
	stopTimeout  = 10 * time.Second
)

// Start runs versitygw (bin, from Binary) over the directory root on a
// free loopback port and waits until it answers. Stop ends it.
func Start(bin, root string) (*Server, error) {
	var lastErr error
	for try := 0; try < 5; try++ {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		cmd := exec.Command(bin, "--access", AccessKey, "--secret", SecretKey, "--region", Region,
			"--port", addr, "--keep-alive", "--quiet", "posix", "--io-buffer-size", "16384", root)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		// A parent that dies without Stop (a crashed test) takes it along.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("starting versitygw: %w", err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		if err := waitUp(addr, exited); err != nil {
			_ = cmd.Process.Kill()
			lastErr = fmt.Errorf("%v\n%s", err, out.String())
			continue // the port may have been taken meanwhile
		}
		return &Server{Endpoint: "http://" + addr, Root: root, Client: NewClient("http://" + addr), cmd: cmd, exited: exited}, nil
	}
	return nil, fmt.Errorf("versitygw did not start: %w", lastErr)
}

// Stop interrupts versitygw and waits for it (killing it after 10 s).
// Calling it again is a no-op.
func (s *Server) Stop() {
	if s.exited == nil {
		return
	}
	_ = s.cmd.Process.Signal(os.Interrupt)
	select {
	case <-s.exited:
	case <-time.After(stopTimeout):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
	s.exited = nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitUp waits for an HTTP answer on addr.
func waitUp(addr string, exited <-chan error) error {
	deadline := time.Now().Add(startTimeout)
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("versitygw exited: %v", err)
		default:
		}
		resp, err := http.Get("http://" + addr + "/")
		if err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("versitygw did not answer on %s within %v", addr, startTimeout)
}

// NewClient is an SDK client for a server at endpoint.
func NewClient(endpoint string) *s3.Client {
	return s3.New(s3.Options{
		Region:                     Region,
		BaseEndpoint:               aws.String(endpoint),
		UsePathStyle:               true,
		Credentials:                credentials.NewStaticCredentialsProvider(AccessKey, SecretKey, ""),
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
	})
}

// Env is the environment a client of the server needs (the standard AWS
// variables), as KEY=VALUE: no shared config files, no instance metadata.
func Env() []string {
	return []string{
		"AWS_ACCESS_KEY_ID=" + AccessKey,
		"AWS_SECRET_ACCESS_KEY=" + SecretKey,
		"AWS_REGION=" + Region,
		"AWS_CONFIG_FILE=" + os.DevNull,
		"AWS_SHARED_CREDENTIALS_FILE=" + os.DevNull,
		"AWS_EC2_METADATA_DISABLED=true",
	}
}

// Bucket creates a bucket.
func (s *Server) Bucket(ctx context.Context, name string) error {
	if _, err := s.Client.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: &name}); err != nil {
		return fmt.Errorf("create bucket %s: %w", name, err)
	}
	return nil
}

// Put writes one object.
func (s *Server) Put(ctx context.Context, bucket, key string, data []byte) error {
	_, err := s.Client.PutObject(ctx, &s3.PutObjectInput{
		Bucket: &bucket, Key: &key, Body: bytes.NewReader(data), ContentLength: aws.Int64(int64(len(data))),
	})
	if err != nil {
		return fmt.Errorf("put s3://%s/%s: %w", bucket, key, err)
	}
	return nil
}

// PutFile writes one object from a file, streamed (shards are gigabytes).
func (s *Server) PutFile(ctx context.Context, bucket, key, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	_, err = s.Client.PutObject(ctx, &s3.PutObjectInput{
		Bucket: &bucket, Key: &key, Body: f, ContentLength: aws.Int64(fi.Size()),
	})
	if err != nil {
		return fmt.Errorf("put %s as s3://%s/%s: %w", path, bucket, key, err)
	}
	return nil
}

// Upload copies every regular file directly in dir for which keep returns
// true (nil: every one) to bucket/prefix/ and returns s3://bucket/prefix
// and the bytes uploaded.
func (s *Server) Upload(ctx context.Context, dir, bucket, prefix string, keep func(name string) bool) (string, int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", 0, err
	}
	prefix = strings.Trim(prefix, "/")
	var n int64
	for _, e := range entries {
		if !e.Type().IsRegular() || (keep != nil && !keep(e.Name())) {
			continue
		}
		if err := s.PutFile(ctx, bucket, prefix+"/"+e.Name(), filepath.Join(dir, e.Name())); err != nil {
			return "", n, err
		}
		if fi, err := e.Info(); err == nil {
			n += fi.Size()
		}
	}
	return "s3://" + bucket + "/" + prefix, n, nil
}
