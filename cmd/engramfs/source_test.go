package main

import (
	"errors"
	"flag"
	"io"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/backing/s3source"
	"github.com/engramfs/engramfs/internal/stats"
)

func TestOpenSourcePicksByURL(t *testing.T) {
	parse := func(args ...string) mountFlags {
		fl := flag.NewFlagSet("mount", flag.ContinueOnError)
		fl.SetOutput(io.Discard)
		var mf mountFlags
		mf.register(fl)
		if err := fl.Parse(args); err != nil {
			t.Fatal(err)
		}
		return mf
	}
	dir := t.TempDir()
	src, err := openSource(dir, parse(), nil, nil, nil)
	if _, ok := src.(*backing.LocalSource); err != nil || !ok {
		t.Fatalf("openSource(%s) = %T, %v; want a local source", dir, src, err)
	}
	var ue usageError
	if _, err := openSource(dir, parse("--s3-endpoint", "http://127.0.0.1:1"), nil, nil, nil); !errors.As(err, &ue) {
		t.Errorf("--s3-endpoint with a directory: %v, want a usage error", err)
	}
	if _, err := openSource("s3://", parse(), nil, nil, nil); !errors.As(err, &ue) {
		t.Errorf("s3:// without a bucket: %v, want a usage error", err)
	}
	if mf := parse("--s3-path-style=false"); !mf.s3PathStyle.set || mf.s3PathStyle.value {
		t.Errorf("--s3-path-style=false parsed to %+v", mf.s3PathStyle)
	}
	if mf := parse("--s3-path-style"); !mf.s3PathStyle.set || !mf.s3PathStyle.value {
		t.Errorf("--s3-path-style parsed to %+v", mf.s3PathStyle)
	}
}

// --s3-mirror and --s3-mirror-size reach the source, together only, with
// an s3:// MODEL_DIR only.
func TestS3MirrorFlags(t *testing.T) {
	fakeAWSEnv(t)
	parse := func(args ...string) mountFlags {
		fl := flag.NewFlagSet("mount", flag.ContinueOnError)
		fl.SetOutput(io.Discard)
		var mf mountFlags
		mf.register(fl)
		if err := fl.Parse(args); err != nil {
			t.Fatal(err)
		}
		mf.queueDepth = 8
		return mf
	}
	mdir := t.TempDir()
	const url = "s3://models/dsv41"
	args := []string{"--s3-endpoint", "http://127.0.0.1:1", "--s3-mirror", mdir, "--s3-mirror-size", "100GiB"}
	src, err := openSource(url, parse(args...), nil, &stats.Counters{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s3, ok := src.(*s3source.Source)
	if !ok {
		t.Fatalf("openSource(%s) = %T", url, src)
	}
	defer s3.Close()
	if got := s3.Mirror(); got.Dir != mdir || got.Size != 100<<30 || got.FillRate != 0 {
		t.Errorf("mirror %+v, want %s and 100 GiB, no fill", got, mdir)
	}
	// The directory is taken: a second mount over it fails.
	if _, err := openSource(url, parse(args...), nil, &stats.Counters{}, nil); err == nil {
		t.Error("a second source over a mirror directory in use: no error")
	}
	var ue usageError
	for _, bad := range [][]string{
		{"--s3-mirror", mdir},
		{"--s3-mirror-size", "10GiB"},
		{"--s3-mirror", mdir, "--s3-mirror-size", "lots"},
		{"--s3-mirror", mdir, "--s3-mirror-size", "1MiB"},
		{"--s3-fill-rate", "50MiB"},
		{"--s3-mirror", mdir, "--s3-mirror-size", "1GiB", "--s3-fill-rate", "fast"},
	} {
		if _, err := openSource(url, parse(bad...), nil, &stats.Counters{}, nil); !errors.As(err, &ue) {
			t.Errorf("%q: %v, want a usage error", bad, err)
		}
	}
	if _, err := openSource(t.TempDir(), parse("--s3-mirror", mdir, "--s3-mirror-size", "1GiB"), nil, nil, nil); !errors.As(err, &ue) {
		t.Errorf("--s3-mirror with a directory MODEL_DIR: %v, want a usage error", err)
	}
}

func TestQueueDepthDefaults(t *testing.T) {
	for _, c := range []struct {
		dir       string
		set, want int
	}{
		{"/models/m", 0, 64},
		{"s3://bucket/prefix", 0, 256},
		{"s3://bucket/prefix", 32, 32},
		{"/models/m", 8, 8},
		{"/models/m", -1, -1}, // refused by startDaemon
	} {
		if got := queueDepthFor(c.dir, c.set); got != c.want {
			t.Errorf("queueDepthFor(%q, %d) = %d, want %d", c.dir, c.set, got, c.want)
		}
	}
}

// --s3-fill-rate reaches the mirror's configuration, and -o s3_fill_rate=
// is its fstab spelling.
func TestS3FillRateFlag(t *testing.T) {
	fl := flag.NewFlagSet("mount", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	var mf mountFlags
	mf.register(fl)
	if err := fl.Parse([]string{"--s3-mirror", "/m", "--s3-mirror-size", "1GiB", "--s3-fill-rate", "50MiB"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := mf.mirrorConfig()
	if err != nil || cfg.FillRate != 50<<20 || cfg.Dir != "/m" {
		t.Errorf("mirror config %+v, %v; want a fill rate of 50 MiB/s", cfg, err)
	}
	flags, _, err := mountArgs(helperArgs{options: []string{"s3_mirror=/m", "s3_mirror_size=1GiB", "s3_fill_rate=50MiB"}}, io.Discard)
	if err != nil || !slices.Contains(flags, "--s3-fill-rate=50MiB") {
		t.Errorf("-o s3_fill_rate=50MiB: %q, %v", flags, err)
	}
}

// --s3-attempt-timeout and --s3-stall-timeout reach the source; bad values
// are usage errors; the defaults are the source's.
func TestS3TimeoutFlags(t *testing.T) {
	fakeAWSEnv(t)
	open := func(args ...string) (*s3source.Source, error) {
		fl := flag.NewFlagSet("mount", flag.ContinueOnError)
		fl.SetOutput(io.Discard)
		var mf mountFlags
		mf.register(fl)
		if err := fl.Parse(append([]string{"--s3-endpoint", "http://127.0.0.1:1"}, args...)); err != nil {
			t.Fatal(err)
		}
		mf.queueDepth = 8
		src, err := openSource("s3://models/m", mf, nil, &stats.Counters{}, nil)
		if err != nil {
			return nil, err
		}
		return src.(*s3source.Source), nil
	}
	src, err := open()
	if err != nil {
		t.Fatal(err)
	}
	if d := s3source.DefaultConfig(); src.Config().AttemptTimeout != d.AttemptTimeout || src.Config().StallTimeout != d.StallTimeout {
		t.Errorf("defaults: %v and %v, want %v and %v", src.Config().AttemptTimeout, src.Config().StallTimeout, d.AttemptTimeout, d.StallTimeout)
	}
	src, err = open("--s3-attempt-timeout", "10s", "--s3-stall-timeout", "750ms")
	if err != nil {
		t.Fatal(err)
	}
	if c := src.Config(); c.AttemptTimeout != 10*time.Second || c.StallTimeout != 750*time.Millisecond {
		t.Errorf("--s3-attempt-timeout 10s --s3-stall-timeout 750ms: %v and %v", c.AttemptTimeout, c.StallTimeout)
	}
	var ue usageError
	for _, bad := range [][]string{
		{"--s3-attempt-timeout", "soon"}, {"--s3-attempt-timeout", "0s"}, {"--s3-stall-timeout", "-1s"},
		{"--s3-attempt-timeout", "1s", "--s3-stall-timeout", "5s"},
	} {
		if _, err := open(bad...); !errors.As(err, &ue) {
			t.Errorf("%q: %v, want a usage error", bad, err)
		}
	}
	flags, _, err := mountArgs(helperArgs{options: []string{"s3_attempt_timeout=10s", "s3_stall_timeout=1s"}}, io.Discard)
	if err != nil || !slices.Contains(flags, "--s3-attempt-timeout=10s") || !slices.Contains(flags, "--s3-stall-timeout=1s") {
		t.Errorf("-o s3_attempt_timeout=10s,s3_stall_timeout=1s: %q, %v", flags, err)
	}
}

// fakeAWSEnv gives the SDK credentials and no files or metadata service to
// look for others in.
func fakeAWSEnv(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
}
