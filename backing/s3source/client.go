package s3source

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go"
	smithyendpoints "github.com/aws/smithy-go/endpoints"
	"github.com/aws/smithy-go/middleware"
	smithyhttp "github.com/aws/smithy-go/transport/http"
)

// objectClient is all engramfs asks of an object store. The SDK client
// implements it for real stores; fake_test.go implements it with injected
// faults.
type objectClient interface {
	// Head returns an object's size and ETag; a missing object is an error
	// matching fs.ErrNotExist.
	Head(ctx context.Context, key string) (size int64, etag string, err error)
	// GetRange starts a GET of bytes [off, off+n) of key, conditional on
	// its ETag (If-Match). It returns once the response headers arrived and
	// were checked: a 206 with exactly that Content-Range. The body may
	// still be short (truncated): the caller reads and checks it.
	GetRange(ctx context.Context, key string, off, n int64, etag string) (io.ReadCloser, error)
	// List returns the keys directly under prefix (which ends in "/").
	List(ctx context.Context, prefix string) ([]string, error)
}

// Errors of objectClient, matched with errors.Is.
var (
	// errPrecondition: 412, the object's ETag is no longer the one asked
	// for (it was rewritten).
	errPrecondition = errors.New("precondition failed (ETag changed)")
	// errRetryable marks a failure worth another attempt: 5xx, 429,
	// connection reset, truncated body, a 200 to a range request.
	errRetryable = errors.New("retryable")
)

// retryableError wraps err so that errors.Is(err, errRetryable) holds.
type retryableError struct{ err error }

func (e retryableError) Error() string   { return e.err.Error() }
func (e retryableError) Unwrap() []error { return []error{e.err, errRetryable} }

func retryable(err error) error           { return retryableError{err} }
func retryablef(f string, a ...any) error { return retryable(fmt.Errorf(f, a...)) }

// rangeHeader asks for bytes [off, off+n); contentRange is how a 206 for
// them starts (the total size follows).
func rangeHeader(off, n int64) string  { return fmt.Sprintf("bytes=%d-%d", off, off+n-1) }
func contentRange(off, n int64) string { return fmt.Sprintf("bytes %d-%d/", off, off+n-1) }

// ErrNoCredentials is the error of a source opened with no credentials to
// sign its requests with.
var ErrNoCredentials = errors.New("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, " +
	"or AWS_PROFILE to a profile of ~/.aws/credentials or ~/.aws/config, or run with an instance or container role")

// ClientConfig says how to reach the object store. Credentials come from
// the standard AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
// AWS_SESSION_TOKEN, AWS_PROFILE, ...) and are never logged.
type ClientConfig struct {
	Endpoint string // "": AWS; e.g. http://127.0.0.1:7070 for a self-hosted store
	Region   string // "": AWS_REGION, else us-east-1
	// PathStyle addresses buckets as endpoint/bucket/key (self-hosted
	// stores) instead of bucket.endpoint/key.
	PathStyle bool
	// Conns is the most connections kept per host: at least the GETs in
	// flight, or every burst pays new TCP (and TLS) handshakes.
	Conns int
}

// sdkClient is objectClient over aws-sdk-go-v2: HEAD and LIST through
// the SDK client, the data path (GetRange) through signedGetter.
type sdkClient struct {
	api    *s3.Client
	bucket string
	data   *signedGetter
}

// newSDKClient configures the SDK for this job: no retries of its own
// (engramfs retries and hedges), checksums only when an operation requires
// them (the defaults add CRC headers that third-party stores refuse), and
// its own connection pool sized to the concurrency.
func newSDKClient(ctx context.Context, bucket string, cc ClientConfig) (*sdkClient, error) {
	// A BuildableClient, not an http.Client: config adds AWS_CA_BUNDLE to it.
	hc := awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
		tr.MaxIdleConns = 2 * cc.Conns
		tr.MaxIdleConnsPerHost = 2 * cc.Conns
		tr.IdleConnTimeout = 90 * time.Second
		tr.ResponseHeaderTimeout = 30 * time.Second
		tr.DisableCompression = true // byte ranges of the object, never re-encoded
	})
	opts := []func(*config.LoadOptions) error{
		config.WithHTTPClient(hc),
		config.WithRetryer(func() aws.Retryer { return aws.NopRetryer{} }),
		config.WithRequestChecksumCalculation(aws.RequestChecksumCalculationWhenRequired),
		config.WithResponseChecksumValidation(aws.ResponseChecksumValidationWhenRequired),
	}
	if cc.Region != "" {
		opts = append(opts, config.WithRegion(cc.Region))
	}
	cfg, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("object store configuration: %w", err)
	}
	// Credentials are looked for now, not at the first request: with none
	// in the environment or the files, the SDK's chain ends at the EC2
	// metadata service, and its error ("no EC2 IMDS role found") named
	// neither S3 nor what to set.
	if _, anon := cfg.Credentials.(aws.AnonymousCredentials); cfg.Credentials != nil && !anon {
		if _, err := cfg.Credentials.Retrieve(ctx); err != nil {
			return nil, fmt.Errorf("%w (%v)", ErrNoCredentials, err)
		}
	}
	if cfg.Region == "" {
		cfg.Region = "us-east-1"
	}
	api := s3.NewFromConfig(cfg, func(o *s3.Options) {
		if cc.Endpoint != "" {
			o.BaseEndpoint = aws.String(cc.Endpoint)
		}
		o.UsePathStyle = cc.PathStyle
		o.RetryMaxAttempts = 1
		o.DisableLogOutputChecksumValidationSkipped = true
		if cc.Endpoint != "" {
			if u, err := url.Parse(cc.Endpoint); err == nil && u.Host != "" {
				o.EndpointResolverV2 = fixedEndpoint{base: *u, pathStyle: cc.PathStyle}
			}
		}
		o.APIOptions = append(o.APIOptions, trimStack)
	})
	data, err := newSignedGetter(ctx, api, bucket)
	if err != nil {
		return nil, err
	}
	return &sdkClient{api: api, bucket: bucket, data: data}, nil
}

func (c *sdkClient) Head(ctx context.Context, key string) (int64, string, error) {
	out, err := c.api.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &c.bucket, Key: &key})
	if err != nil {
		return 0, "", classify(err, "HEAD "+key)
	}
	if out.ETag == nil || out.ContentLength == nil {
		return 0, "", fmt.Errorf("HEAD %s: no ETag or Content-Length in the answer", key)
	}
	return *out.ContentLength, *out.ETag, nil
}

func (c *sdkClient) GetRange(ctx context.Context, key string, off, n int64, etag string) (io.ReadCloser, error) {
	return c.data.GetRange(ctx, key, off, n, etag)
}

// getRangeSDK is GetRange through the SDK's GetObject: the data path
// before signedGetter, kept for BenchmarkGetRangeSDK.
func (c *sdkClient) getRangeSDK(ctx context.Context, key string, off, n int64, etag string) (io.ReadCloser, error) {
	out, err := c.api.GetObject(ctx, &s3.GetObjectInput{
		Bucket: &c.bucket, Key: &key, Range: aws.String(rangeHeader(off, n)), IfMatch: aws.String(etag),
	})
	if err != nil {
		return nil, classify(err, "GET "+key)
	}
	status := 0
	if raw, ok := awsmiddleware.GetRawResponse(out.ResultMetadata).(*smithyhttp.Response); ok {
		status = raw.StatusCode
	}
	if err := checkRange(status, aws.ToString(out.ContentRange), aws.ToInt64(out.ContentLength), off, n); err != nil {
		out.Body.Close()
		return nil, fmt.Errorf("GET %s: %w", key, err)
	}
	return out.Body, nil
}

// checkRange accepts nothing but a 206 for exactly the bytes asked: a 200
// (the whole object, from a store or proxy that ignores Range) is an error,
// never data.
func checkRange(status int, cr string, length, off, n int64) error {
	if status != http.StatusPartialContent {
		return retryablef("range [%d, +%d): HTTP %d instead of 206 Partial Content", off, n, status)
	}
	if !strings.HasPrefix(cr, contentRange(off, n)) || length != n {
		return retryablef("range [%d, +%d): Content-Range %q, Content-Length %d", off, n, cr, length)
	}
	return nil
}

func (c *sdkClient) List(ctx context.Context, prefix string) ([]string, error) {
	var keys []string
	p := s3.NewListObjectsV2Paginator(c.api, &s3.ListObjectsV2Input{
		Bucket: &c.bucket, Prefix: &prefix, Delimiter: aws.String("/"),
	})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return nil, classify(err, "LIST "+prefix)
		}
		for _, o := range page.Contents {
			keys = append(keys, aws.ToString(o.Key))
		}
	}
	return keys, nil
}

// fixedEndpoint resolves a self-hosted store's endpoint without the S3
// rules engine, which costs more client CPU per GET than the HTTP exchange
// itself. Signing uses the client's region and the s3 service name.
type fixedEndpoint struct {
	base      url.URL
	pathStyle bool
}

func (r fixedEndpoint) ResolveEndpoint(_ context.Context, p s3.EndpointParameters) (smithyendpoints.Endpoint, error) {
	u := r.base
	if b := aws.ToString(p.Bucket); b != "" {
		if r.pathStyle {
			u.Path = strings.TrimSuffix(u.Path, "/") + "/" + b
		} else {
			u.Host = b + "." + u.Host
		}
	}
	return smithyendpoints.Endpoint{URI: u}, nil
}

// trimStack removes the SDK middleware engramfs has no use for: request ids,
// user agent and recursion headers, response timing, checksum tracking, the
// logger. Each costs allocations on every GET (measured by
// BenchmarkGetRangeSDK against a bare net/http GET).
func trimStack(s *middleware.Stack) error {
	for _, id := range []string{"ClientRequestID", "AWSChecksum:ResponseMetricsTracking", "UserAgent", "RecursionDetection"} {
		_, _ = s.Build.Remove(id)
	}
	for _, id := range []string{"RecordResponseTiming", "RequestResponseLogger"} {
		_, _ = s.Deserialize.Remove(id)
	}
	for _, id := range []string{"InterceptBeforeRetryLoop", "InterceptAttempt"} {
		_, _ = s.Finalize.Remove(id)
	}
	return nil
}

// classify maps an SDK error to the errors of objectClient.
func classify(err error, op string) error {
	var re *smithyhttp.ResponseError
	if errors.As(err, &re) {
		code := re.HTTPStatusCode()
		var ae smithy.APIError
		msg := ""
		if errors.As(err, &ae) {
			msg = ae.ErrorCode()
		}
		switch {
		case code == 0: // the request was not sent, or no answer came: reset, refused, EOF
			return retryablef("%s: %w", op, err)
		case code == http.StatusPreconditionFailed:
			return fmt.Errorf("%s: %w", op, errPrecondition)
		case code == http.StatusNotFound:
			return fmt.Errorf("%s: %w (%s)", op, fs.ErrNotExist, msg)
		case code >= 500 || code == http.StatusTooManyRequests || code == http.StatusRequestTimeout:
			return retryablef("%s: HTTP %d %s", op, code, msg)
		default:
			return fmt.Errorf("%s: HTTP %d %s: %w", op, code, msg, err)
		}
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s: %w", op, err)
	}
	// Anything else failed below HTTP: reset, refused, EOF, timeout.
	return retryablef("%s: %w", op, err)
}
