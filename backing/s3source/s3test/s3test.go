// Package s3test runs a real S3 server for tests: versitygw with its posix
// backend on 127.0.0.1, started per test and stopped by PID in cleanup.
//
// Install it with
//
//	go install github.com/versity/versitygw/cmd/versitygw@v1.8.0
//
// Without it the tests skip, or fail when ENGRAMFS_REQUIRE_S3=1 (CI).
package s3test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// RequireEnv makes a missing versitygw fail the tests instead of skipping
// them.
const RequireEnv = "ENGRAMFS_REQUIRE_S3"

// Credentials of the test server's root user (loopback only).
const (
	AccessKey = "engramfs-test-access"
	SecretKey = "engramfs-test-secret-key"
	Region    = "us-east-1"
)

// Server is a running versitygw.
type Server struct {
	Endpoint string // http://127.0.0.1:PORT
	Root     string // the posix backend's directory: buckets are its subdirectories
	Client   *s3.Client
	cmd      *exec.Cmd
}

// Binary finds versitygw in $PATH or $(go env GOPATH)/bin; it skips (or
// fails, under ENGRAMFS_REQUIRE_S3=1) when there is none.
func Binary(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p
	}
	gopath := os.Getenv("GOPATH")
	if gopath == "" {
		if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
			gopath = strings.TrimSpace(string(out))
		}
	}
	for _, dir := range filepath.SplitList(gopath) {
		p := filepath.Join(dir, "bin", "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	why := "versitygw not found in $PATH or $(go env GOPATH)/bin: go install github.com/versity/versitygw/cmd/versitygw@v1.8.0"
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%s (%s=1: S3 tests are required)", why, RequireEnv)
	}
	t.Skip(why)
	return ""
}

// Start runs versitygw on a free loopback port over a fresh directory and
// waits until it answers. Cleanup stops it.
func Start(t testing.TB) *Server {
	t.Helper()
	bin := Binary(t)
	root := t.TempDir()
	var lastErr error
	for try := 0; try < 5; try++ {
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		cmd := exec.Command(bin, "--access", AccessKey, "--secret", SecretKey, "--region", Region,
			"--port", addr, "--keep-alive", "--quiet", "posix", "--io-buffer-size", "16384", root)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting versitygw: %v", err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		s := &Server{Endpoint: "http://" + addr, Root: root, cmd: cmd}
		if err := waitUp(addr, exited); err != nil {
			_ = cmd.Process.Kill()
			lastErr = fmt.Errorf("%v\n%s", err, out.String())
			continue // the port may have been taken meanwhile
		}
		t.Cleanup(func() {
			_ = cmd.Process.Signal(os.Interrupt)
			select {
			case <-exited:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
			}
		})
		s.Client = NewClient(s.Endpoint)
		return s
	}
	t.Fatalf("versitygw did not start: %v", lastErr)
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitUp waits (generously: other builds share the machine) for an HTTP
// answer on addr.
func waitUp(addr string, exited <-chan error) error {
	deadline := time.Now().Add(30 * time.Second)
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
	return fmt.Errorf("versitygw did not answer on %s within 30 s", addr)
}

// NewClient is an SDK client for the test server, for setup (buckets,
// uploads, rewrites): not the client under test.
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

// Env sets the standard AWS variables for a client of s (this process's
// SDK config, or a child's environment) for the duration of the test.
func (s *Server) Env(t testing.TB) {
	t.Setenv("AWS_ACCESS_KEY_ID", AccessKey)
	t.Setenv("AWS_SECRET_ACCESS_KEY", SecretKey)
	t.Setenv("AWS_REGION", Region)
	// No shared config files or instance metadata lookups in tests.
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
}

// Bucket creates a bucket.
func (s *Server) Bucket(t testing.TB, name string) {
	t.Helper()
	if _, err := s.Client.CreateBucket(context.Background(), &s3.CreateBucketInput{Bucket: &name}); err != nil {
		t.Fatalf("create bucket %s: %v", name, err)
	}
}

// Put writes one object.
func (s *Server) Put(t testing.TB, bucket, key string, data []byte) {
	t.Helper()
	_, err := s.Client.PutObject(context.Background(), &s3.PutObjectInput{
		Bucket: &bucket, Key: &key, Body: bytes.NewReader(data), ContentLength: aws.Int64(int64(len(data))),
	})
	if err != nil {
		t.Fatalf("put s3://%s/%s: %v", bucket, key, err)
	}
}

// Upload copies every regular file directly in dir to bucket/prefix/ and
// returns s3://bucket/prefix.
func (s *Server) Upload(t testing.TB, dir, bucket, prefix string) string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		s.Put(t, bucket, strings.TrimSuffix(prefix, "/")+"/"+e.Name(), b)
	}
	return "s3://" + bucket + "/" + strings.TrimSuffix(prefix, "/")
}
