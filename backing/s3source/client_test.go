package s3source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
)

// The SDK client's answers, classified: what the fake cannot show, since
// it produces the classified errors itself.
func TestSDKClientClassifies(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	data := make([]byte, 8192)
	for i := range data {
		data[i] = byte(i * 7)
	}
	var modeV atomic.Value // the handler reads it on its own goroutine
	modeV.Store("")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Range") != "bytes=100-4195" || r.Header.Get("If-Match") != `"e1"` {
			http.Error(w, "unexpected request", http.StatusBadRequest)
			return
		}
		mode := modeV.Load().(string)
		switch mode {
		case "206":
			w.Header().Set("Content-Range", "bytes 100-4195/8192")
			w.Header().Set("Content-Length", "4096")
			w.WriteHeader(http.StatusPartialContent)
			_, _ = w.Write(data[100:4196])
		case "200":
			w.Header().Set("Content-Length", "8192")
			_, _ = w.Write(data)
		case "412", "503", "404":
			code := map[string]int{"412": 412, "503": 503, "404": 404}[mode]
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(code)
			fmt.Fprintf(w, "<Error><Code>E%d</Code><Message>m</Message></Error>", code)
		case "reset":
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
		}
	}))
	defer srv.Close()
	c, err := newSDKClient(context.Background(), "b", ClientConfig{Endpoint: srv.URL, PathStyle: true, Region: "us-east-1", Conns: 4})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		mode                     string
		retryable, precond, gone bool
	}{
		{"206", false, false, false},
		{"200", true, false, false},
		{"503", true, false, false},
		{"reset", true, false, false},
		{"412", false, true, false},
		{"404", false, false, true},
	} {
		modeV.Store(tc.mode)
		body, err := c.GetRange(context.Background(), "k", 100, 4096, `"e1"`)
		if tc.mode == "206" {
			if err != nil {
				t.Fatalf("206: %v", err)
			}
			got, _ := io.ReadAll(body)
			body.Close()
			if string(got) != string(data[100:4196]) {
				t.Fatal("206: wrong bytes")
			}
			continue
		}
		if err == nil {
			body.Close()
			t.Fatalf("%s: no error", tc.mode)
		}
		if errors.Is(err, errRetryable) != tc.retryable || errors.Is(err, errPrecondition) != tc.precond ||
			errors.Is(err, fs.ErrNotExist) != tc.gone {
			t.Errorf("%s: %v: retryable %v precondition %v not-exist %v; want %v %v %v", tc.mode, err,
				errors.Is(err, errRetryable), errors.Is(err, errPrecondition), errors.Is(err, fs.ErrNotExist),
				tc.retryable, tc.precond, tc.gone)
		}
	}
}

// No credentials anywhere is said as such, at open, with what to set; the
// SDK's chain ended at the EC2 metadata service, whose error named neither.
func TestMissingCredentialsAreNamed(t *testing.T) {
	for _, k := range []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
		"AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	_, err := newSDKClient(context.Background(), "b", ClientConfig{Endpoint: "http://127.0.0.1:1", PathStyle: true, Conns: 1})
	if !errors.Is(err, ErrNoCredentials) || !strings.Contains(err.Error(), "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE") {
		t.Fatalf("open without credentials: %v, want %v", err, ErrNoCredentials)
	}
	t.Log(err)
}
