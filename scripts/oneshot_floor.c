// The floor of a one-shot all_reduce on this machine, without the library: two threads pinned
// to CPUs 0 and 1 run the one-shot protocol (copy the input into this thread's slot, of two
// alternating, publish a counter, wait for the peer's, fold both slots into the output) on
// float32 sums, timing each phase of every iteration with rdtsc (docs/algorithms.md, one-shot).
//   gcc -O3 -march=native -mcldemote -pthread scripts/oneshot_floor.c -o target/oneshot_floor
//   target/oneshot_floor BYTES MODE [ITERS]    (BYTES a multiple of 64, at most 65536)
// MODE 0: as the library; 1: cldemote every slot line after the copy (the reader then finds it
// in the shared L3); 2: the copy with streaming stores; 8: the fold replaced by a sum of the
// peer's slot alone (its read cost). Modes 2 and 8 need AVX-512 (this VM's Xeon has it).
// Prints rank 0's 10th percentile and median per phase; the TSC rate is taken as 2.3 GHz
// (this VM's; `grep MHz /proc/cpuinfo`). A measurement tool, not built by cargo or CI.
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>
static size_t S; static int MODE, ITERS;
static float *slot[2][2], *in[2], *out[2];
static _Alignas(64) _Atomic long flag[2][16];
static unsigned long long *ph[2][4];
static int cmpu(const void*a,const void*b){unsigned long long x=*(unsigned long long*)a,y=*(unsigned long long*)b;return x<y?-1:x>y;}
static void wait_for(int p,long v){while(atomic_load_explicit(&flag[p][0],memory_order_acquire)<v)_mm_pause();}
static void *run(void *arg){
  int me=(int)(long)arg, pe=1-me; size_t n=S/4;
  cpu_set_t c; CPU_ZERO(&c); CPU_SET(me,&c); pthread_setaffinity_np(pthread_self(),sizeof c,&c);
  for(long i=1;i<=ITERS;i++){
    unsigned long long t0=__rdtsc();
    float *s=slot[me][i&1];
    if(MODE==2){ for(size_t o=0;o<n;o+=16) _mm512_stream_ps(s+o,_mm512_load_ps(in[me]+o)); _mm_sfence(); }
    else memcpy(s,in[me],S);
    if(MODE==1) for(size_t o=0;o<S;o+=64) _cldemote((char*)s+o);
    unsigned long long t1=__rdtsc();
    atomic_store_explicit(&flag[me][0],i,memory_order_release);
    wait_for(pe,i);
    unsigned long long t2=__rdtsc();
    float *a=slot[0][i&1],*b=slot[1][i&1],*o=out[me];
    if(MODE==8){ // just read the peer slot (sum)
      float *y=slot[pe][i&1]; __m512 acc=_mm512_setzero_ps();
      for(size_t j=0;j<n;j+=16) acc=_mm512_add_ps(acc,_mm512_load_ps(y+j));
      o[0]=_mm512_reduce_add_ps(acc);
    } else for(size_t j=0;j<n;j++) o[j]=a[j]+b[j];
    unsigned long long t3=__rdtsc();
    ph[me][0][i-1]=t1-t0; ph[me][1][i-1]=t2-t1; ph[me][2][i-1]=t3-t2; ph[me][3][i-1]=t3-t0;
  }
  return 0;
}
int main(int argc,char**argv){
  S=atol(argv[1]); MODE=atoi(argv[2]); ITERS=argc>3?atoi(argv[3]):20000;
  for(int r=0;r<2;r++){in[r]=aligned_alloc(4096,S);out[r]=aligned_alloc(4096,S);
    for(int p=0;p<2;p++){slot[r][p]=aligned_alloc(4096,65536);memset(slot[r][p],0,65536);}
    for(size_t j=0;j<S/4;j++)in[r][j]=j*0.5f+r;
    for(int k=0;k<4;k++)ph[r][k]=calloc(ITERS,8);}
  pthread_t t[2]; for(long r=0;r<2;r++)pthread_create(&t[r],0,run,(void*)r);
  for(int r=0;r<2;r++)pthread_join(t[r],0);
  double ghz=2.3; // tsc ~2.3GHz (BogoMIPS 4600)
  printf("S=%6zu mode=%d", S, MODE);
  const char*nm[4]={"copy","wait","reduce","total"};
  for(int k=0;k<4;k++){unsigned long long*l=ph[0][k]+ITERS/4; int m=ITERS-ITERS/4; qsort(l,m,8,cmpu); printf("  %s %.2f/%.2f", nm[k], l[m/10]/ghz/1e3, l[m/2]/ghz/1e3);}
  printf(" us (p10/med, rank 0)\n");
}
