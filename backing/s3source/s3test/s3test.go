// Package s3test runs a real S3 server for tests: s3serve's versitygw,
// started per test and stopped in its cleanup.
//
// Install it with
//
//	go install github.com/versity/versitygw/cmd/versitygw@v1.8.0
//
// Without it the tests skip, or fail when ENGRAMFS_REQUIRE_S3=1 (CI).
package s3test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/engramfs/engramfs/backing/s3source/s3serve"
)

// RequireEnv makes a missing versitygw fail the tests instead of skipping
// them.
const RequireEnv = "ENGRAMFS_REQUIRE_S3"

// Credentials of the test server's root user (loopback only).
const (
	AccessKey = s3serve.AccessKey
	SecretKey = s3serve.SecretKey
	Region    = s3serve.Region
)

// Server is a running versitygw; its methods fail the test on error.
type Server struct {
	*s3serve.Server
}

// Binary finds versitygw in $PATH or $(go env GOPATH)/bin; it skips (or
// fails, under ENGRAMFS_REQUIRE_S3=1) when there is none.
func Binary(t testing.TB) string {
	t.Helper()
	p, err := s3serve.Binary()
	if err == nil {
		return p
	}
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%v (%s=1: S3 tests are required)", err, RequireEnv)
	}
	t.Skip(err)
	return ""
}

// Start runs versitygw on a free loopback port over a fresh directory and
// waits until it answers. Cleanup stops it.
func Start(t testing.TB) *Server {
	t.Helper()
	srv, err := s3serve.Start(Binary(t), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return &Server{srv}
}

// NewClient is an SDK client for the test server, for setup (buckets,
// uploads, rewrites): not the client under test.
func NewClient(endpoint string) *s3.Client { return s3serve.NewClient(endpoint) }

// Env sets the standard AWS variables for a client of s (this process's
// SDK config, or a child's environment) for the duration of the test.
func (s *Server) Env(t testing.TB) {
	for _, kv := range s3serve.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
}

// Bucket creates a bucket.
func (s *Server) Bucket(t testing.TB, name string) {
	t.Helper()
	if err := s.Server.Bucket(context.Background(), name); err != nil {
		t.Fatal(err)
	}
}

// Put writes one object.
func (s *Server) Put(t testing.TB, bucket, key string, data []byte) {
	t.Helper()
	if err := s.Server.Put(context.Background(), bucket, key, data); err != nil {
		t.Fatal(err)
	}
}

// Upload copies every regular file directly in dir to bucket/prefix/ and
// returns s3://bucket/prefix.
func (s *Server) Upload(t testing.TB, dir, bucket, prefix string) string {
	t.Helper()
	url, _, err := s.Server.Upload(context.Background(), dir, bucket, prefix, nil)
	if err != nil {
		t.Fatal(err)
	}
	return url
}
